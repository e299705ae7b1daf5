"""Batch-size ramps beside a sweep: python -m experiments.ramps --config=... --sweep_dir=DIR.

The command lives in `cbs.commands.ramps` (installed as the `cbs-ramps` console script); this
module keeps `python -m experiments.ramps` working from a checkout.
"""

from cbs.commands.ramps import main, run  # noqa: F401 (defines the command's flags)

if __name__ == "__main__":
    run()
