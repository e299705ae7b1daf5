"""Train one run from a config file: python -m experiments.main --config=... --workdir=DIR.

The command lives in `cbs.commands.train` (installed as the `cbs-train` console script); this
module keeps `python -m experiments.main` working from a checkout.
"""

from cbs.commands.train import main, run  # noqa: F401 (defines the command's flags)

if __name__ == "__main__":
    run()
