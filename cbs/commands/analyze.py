"""Fit a finished sweep and write its report: cbs-analyze --sweep_dir=DIR.

Reads only the sweep directory (trials.jsonl, sweep.json, ramps.jsonl); writes analysis.json,
figures/*.png and report.md there (or into --out, e.g. for a read-only or committed study)
and prints B_crit per target beside the measured B_simple and B_noise. An unfinished sweep is
refused with the count per batch size, unless --partial.
"""

from __future__ import annotations

from absl import flags

from cbs import commands
from cbs.analysis.reports import report, report_tables
from cbs.runtime import cli

__all__ = ["main", "run"]

_SWEEP_DIR = flags.DEFINE_string("sweep_dir", None, "A sweep directory.")
_BOOTSTRAP = flags.DEFINE_integer("bootstrap", 1000, "Bootstrap resamples of each fit.")
_SELECT_ON_SEED = flags.DEFINE_integer(
    "select_on_seed", None, "Also select each best learning rate on this seed and measure its "
    "steps on the sweep's other seeds: B_crit held out, beside the in-sample fit (report "
    "section \"Held-out seeds\"; needs a sweep with several seeds).")
_PARTIAL = flags.DEFINE_bool("partial", False, "Write the report of an unfinished sweep, "
                             "headed as partial (otherwise refused).")
_OUT = flags.DEFINE_string("out", None, "Directory for report.md, analysis.json and figures/ "
                           "(default: the sweep directory).")
flags.mark_flags_as_required(["sweep_dir"])


def main(argv: list[str]) -> None:
    del argv
    sweep_dir, out = cli.required(_SWEEP_DIR), _OUT.value
    try:
        path = report.write_report(sweep_dir, bootstrap=_BOOTSTRAP.value,
                                   partial=_PARTIAL.value, select_on_seed=_SELECT_ON_SEED.value,
                                   out_dir=out)
    except PermissionError as err:
        if out:
            raise
        raise ValueError(f"{cli.message(err).split(';')[0]}: the sweep directory is read-only; "
                         "write the report elsewhere with --out=DIR") from None
    print(report_tables.summary_table(report.load_analysis(out or sweep_dir)))
    print(f"report: {path}")


def run() -> None:
    """The `cbs-analyze` console script (and `python -m experiments.analyze`)."""
    commands.make_configs_importable()
    cli.run(main, outputs=("sweep_dir", "out"))


if __name__ == "__main__":
    run()
