"""B_crit against the measured noise scale across studies: python -m experiments.compare DIRS.

The command lives in `cbs.commands.compare` (installed as the `cbs-compare` console script);
this module keeps `python -m experiments.compare` working from a checkout.
"""

from cbs.commands.compare import main, run  # noqa: F401 (defines the command's flags)

if __name__ == "__main__":
    run()
