"""B_crit against the measured noise scale across studies (McCandlish et al. 2018, Fig. 4).

    python -m experiments.compare results/digits results/digits_sgd results/shakespeare_kaplan \
        --out=results/compare --held_out=results/heldout_teacher_student

Re-fits every study from its records (the same analysis as its report) and writes
OUT/report.md (one row per study and target, B_crit/B_simple and B_crit/B_noise per point)
and OUT/b_crit_vs_noise.png (log-log, y = x and the factor-10 band drawn).

With --sizes the studies are model sizes on the same data (Kaplan et al. 2020, Fig. 10):

    python -m experiments.compare --sizes results/shakespeare_kaplan_d32 \
        results/shakespeare_kaplan results/shakespeare_kaplan_d128 --out=results/kaplan_sizes

writes OUT/report.md (B_crit per size and target, a test of "B_crit depends on L alone", the
joint power law) and OUT/b_crit_vs_loss_by_size.png (`cbs.analysis.sizes`).

The inputs are checked first (`check_inputs`): a bad one is one line and nothing is written.
"""

from __future__ import annotations

from absl import flags

from cbs import commands
from cbs.analysis import compare, sizes
from cbs.engine import cli
from cbs.results import files, paths

__all__ = ["check_inputs", "main", "run"]

_OUT = flags.DEFINE_string("out", "results/compare", "Directory for report.md and the figure.")
_BOOTSTRAP = flags.DEFINE_integer("bootstrap", 1000, "Bootstrap resamples of each fit.")
_SIZES = flags.DEFINE_boolean("sizes", False, "The studies are model sizes on one dataset: "
                              "B_crit against the loss by size instead of against the noise.")
_HELD_OUT = flags.DEFINE_list(
    "held_out", [], "Sweep directories of held-out tasks, D, each with D_predict/prediction.json "
    "(its prediction from one run, made before the sweep): the calibration records how many "
    "of their B_crit fell inside the predicted intervals.")


def check_inputs(dirs: list[str], out: str, bootstrap: int, by_size: bool) -> None:
    """Refuses, in one line and before anything is read at length or written, what cannot be
    compared: no study, one named twice, a directory that is not a sweep's, a negative
    --bootstrap (--sizes needs one: at least 2 resamples, and two studies of one experiment,
    `cbs.analysis.sizes.check_comparable`) or an --out that is a file."""
    if not dirs:
        raise ValueError("name one or more sweep directories: python -m "
                         "experiments.compare results/digits results/digits_sgd ...")
    if len(set(dirs)) != len(dirs):
        raise ValueError(f"each study once, please: {dirs} names one twice")
    for d in dirs:
        if not paths.exists(paths.join(d, files.SWEEP_FILE)):
            raise ValueError(f"{d} is not a sweep directory (no {files.SWEEP_FILE}); name "
                             "directories that cbs-sweep wrote")
    if bootstrap < (2 if by_size else 0):
        raise ValueError(f"--bootstrap={bootstrap}: must be >= {2 if by_size else 0}"
                         + (" with --sizes (each study's covariance across targets)"
                            if by_size else ""))
    if by_size:
        if len(dirs) < 2:
            raise ValueError("--sizes needs two or more studies (model sizes of one experiment)")
        sizes.check_comparable(dirs)
    if paths.exists(out) and not paths.isdir(out):
        raise ValueError(f"--out={out} is a file; name a directory")


def main(argv: list[str]) -> None:
    dirs = argv[1:]
    check_inputs(dirs, _OUT.value, _BOOTSTRAP.value, _SIZES.value)
    module = sizes if _SIZES.value else compare
    extra = {} if _SIZES.value else {"held_out": _HELD_OUT.value}
    path = module.write_report(dirs, _OUT.value, bootstrap=_BOOTSTRAP.value, **extra)
    print(paths.read_text(path))
    print(f"report: {path}")


def run() -> None:
    """The `cbs-compare` console script (and `python -m experiments.compare`)."""
    commands.make_configs_importable()
    cli.run(main, outputs=("out",))


if __name__ == "__main__":
    run()
