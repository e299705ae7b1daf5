"""B_crit against the measured noise scale across studies (McCandlish et al. 2018, Fig. 4).

    python -m experiments.compare results/digits results/digits_sgd results/shakespeare_kaplan \
        --out=results/compare

Re-fits every study from its records (the same analysis as its report) and writes
OUT/report.md (one row per study and target, B_crit/B_simple and B_crit/B_noise per point)
and OUT/b_crit_vs_noise.png (log-log, y = x and the factor-10 band drawn).

With --sizes the studies are model sizes on the same data (Kaplan et al. 2020, Fig. 10):

    python -m experiments.compare --sizes results/shakespeare_kaplan_d32 \
        results/shakespeare_kaplan results/shakespeare_kaplan_d128 --out=results/kaplan_sizes

writes OUT/report.md (B_crit per size and target, a test of "B_crit depends on L alone", the
joint power law) and OUT/b_crit_vs_loss_by_size.png (`cbs.analysis.sizes`).
"""

from __future__ import annotations

import pathlib

from absl import flags

from cbs import commands
from cbs.analysis import compare, sizes
from cbs.engine import cli

__all__ = ["main", "run"]

_OUT = flags.DEFINE_string("out", "results/compare", "Directory for report.md and the figure.")
_BOOTSTRAP = flags.DEFINE_integer("bootstrap", 1000, "Bootstrap resamples of each fit.")
_SIZES = flags.DEFINE_boolean("sizes", False, "The studies are model sizes on one dataset: "
                              "B_crit against the loss by size instead of against the noise.")


def main(argv: list[str]) -> None:
    dirs = argv[1:]
    if not dirs:
        raise ValueError("name one or more sweep directories: python -m "
                         "experiments.compare results/digits results/digits_sgd ...")
    module = sizes if _SIZES.value else compare
    path = module.write_report(dirs, _OUT.value, bootstrap=_BOOTSTRAP.value)
    print(pathlib.Path(path).read_text())
    print(f"report: {path}")


def run() -> None:
    """The `cbs-compare` console script (and `python -m experiments.compare`)."""
    commands.make_configs_importable()
    cli.run(main, outputs=("out",))


if __name__ == "__main__":
    run()
