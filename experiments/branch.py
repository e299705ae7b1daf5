"""Local critical batch size by branched training, then its table and figure.

The command lives in `cbs.commands.branch` (installed as the `cbs-branch` console script); this
module keeps `python -m experiments.branch` working from a checkout.
"""

from cbs.commands.branch import main, run  # noqa: F401 (defines the command's flags)

if __name__ == "__main__":
    run()
