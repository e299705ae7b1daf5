"""B_crit against the measured noise scale across studies (McCandlish et al. 2018, Fig. 4).

    cbs-compare results/digits results/digits_sgd results/shakespeare_kaplan \
        --out=results/compare --held_out=results/heldout_teacher_student

Re-fits every study from its records (the same analysis as its report) and writes
OUT/report.md (one row per study and target, B_crit/B_simple and B_crit/B_noise per point)
and OUT/b_crit_vs_noise.png (log-log, y = x and the factor-10 band drawn).

With --sizes the studies are model sizes on the same data (Kaplan et al. 2020, Fig. 10):

    cbs-compare --sizes results/shakespeare_kaplan_d32 \
        results/shakespeare_kaplan results/shakespeare_kaplan_d128 --out=results/kaplan_sizes

writes OUT/report.md (B_crit per size and target, a test of "B_crit depends on L alone", the
joint power law) and OUT/b_crit_vs_loss_by_size.png (`cbs.analysis.studies.sizes`).

Without --out the report goes to a new directory beside the studies (`default_out`). Two
studies whose folders share a name are labelled by as much of their paths as tells them apart.
A bad input is one line and nothing is written (`check_inputs`).
"""

from __future__ import annotations

import os

from absl import flags

from cbs import commands
from cbs.analysis.studies import compare, sizes
from cbs.results import files, paths
from cbs.runtime import cli

__all__ = ["check_inputs", "main", "run"]

_OUT = flags.DEFINE_string("out", None, "Directory for report.md and the figures (default: a "
                           "new directory beside the studies, compare_<first study>...).")
_BOOTSTRAP = flags.DEFINE_integer("bootstrap", 1000, "Bootstrap resamples of each fit.")
_SIZES = flags.DEFINE_boolean("sizes", False, "The studies are model sizes on one dataset: "
                              "B_crit against the loss by size instead of against the noise.")
_HELD_OUT = flags.DEFINE_list(
    "held_out", [], "Sweep directories of held-out tasks, D, each with D_predict/prediction.json "
    "(its prediction from one run, made before the sweep): the calibration records how many "
    "of their B_crit fell inside the predicted intervals.")


def check_inputs(dirs: list[str], out: str | None, bootstrap: int, by_size: bool) -> None:
    """Refuses bad inputs in one line (ValueError), before anything is read at length or
    written; --sizes also needs comparable studies (`cbs.analysis.studies.sizes`)."""
    if not dirs:
        raise ValueError("name one or more sweep directories: cbs-compare results/digits "
                         "results/digits_sgd ...")
    full = [compare.study_path(d) for d in dirs]
    twice = sorted({d for d, p in zip(dirs, full, strict=True) if full.count(p) > 1})
    if twice:
        raise ValueError(f"each study once, please: {', '.join(twice)} name one study twice")
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
    if out is not None and paths.exists(out) and not paths.isdir(out):
        raise ValueError(f"--out={out} is a file; name a directory")


def default_out(dirs: list[str]) -> str:
    """The report's directory without --out: a new one beside the studies,
    compare_<first study's folder>[_and_<n>_more] (then _2, _3, ... while that exists)."""
    full = [compare.study_path(d) for d in dirs]
    parents = sorted({os.path.dirname(p) for p in full})
    if len(parents) != 1:
        raise ValueError(f"the studies sit in {len(parents)} directories "
                         f"({', '.join(parents)}): name where the report goes with --out=DIR")
    name = f"compare_{os.path.basename(full[0])}" + (
        f"_and_{len(full) - 1}_more" if len(full) > 1 else "")
    out, k = paths.join(parents[0], name), 1
    while paths.exists(out):
        k += 1
        out = paths.join(parents[0], f"{name}_{k}")
    return out


def main(argv: list[str]) -> None:
    dirs = argv[1:]
    check_inputs(dirs, _OUT.value, _BOOTSTRAP.value, _SIZES.value)
    out = _OUT.value or default_out(dirs)
    module = sizes if _SIZES.value else compare
    extra = {} if _SIZES.value else {"held_out": _HELD_OUT.value}
    try:
        path = module.write_report(dirs, out, bootstrap=_BOOTSTRAP.value, **extra)
    except BaseException:
        if not _OUT.value and not paths.is_remote(out):
            paths.remove_if_empty(out)  # the new directory, when nothing was written
        raise
    print(paths.read_text(path))
    print(f"report: {path}" + ("" if _OUT.value else
                               " (a new directory beside the studies; --out=DIR names another)"))


def run() -> None:
    """The `cbs-compare` console script (and `python -m experiments.compare`)."""
    commands.make_configs_importable()
    cli.run(main, outputs=("out",))


if __name__ == "__main__":
    run()
