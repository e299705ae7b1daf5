"""B_crit against the measured noise scale across studies (McCandlish et al. 2018, Fig. 4).

    python -m experiments.compare results/digits results/digits_sgd results/shakespeare_kaplan \
        --out=results/compare

Re-fits every study from its records (the same analysis as its report) and writes
OUT/report.md (one row per study and target, B_crit/B_simple and B_crit/B_noise per point)
and OUT/b_crit_vs_noise.png (log-log, y = x and the factor-10 band drawn).
"""

from __future__ import annotations

from absl import flags

from cbs import commands
from cbs.analysis import compare
from cbs.engine import cli

_OUT = flags.DEFINE_string("out", "results/compare", "Directory for report.md and the figure.")
_BOOTSTRAP = flags.DEFINE_integer("bootstrap", 1000, "Bootstrap resamples of each fit.")


def main(argv: list[str]) -> None:
    dirs = argv[1:]
    if not dirs:
        raise ValueError("name one or more sweep directories: python -m "
                             "experiments.compare results/digits results/digits_sgd ...")
    path = compare.write_report(dirs, _OUT.value, bootstrap=_BOOTSTRAP.value)
    print(open(path).read())
    print(f"report: {path}")


def run() -> None:
    """The `cbs-compare` console script (and `python -m experiments.compare`)."""
    commands.make_configs_importable()
    cli.run(main, outputs=("out",))


if __name__ == "__main__":
    run()
