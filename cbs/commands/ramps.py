"""Batch-size ramps beside a sweep: cbs-ramps --config=... --sweep_dir=DIR.

Validates the sweep and every ramp first (nothing is written for a bad config), finishes the
config's sweep in DIR if needed, runs every `config.ramps` entry not yet in DIR/ramps.jsonl
(`cbs.sweeps.ramps`) and rewrites the report with the ramps on each target's S–E frontier.
With --out_dir=OUT the ramps go to OUT and DIR is only read; for runs repeated over seeds
(entries with `name` and `seed`), OUT/payoff.md compares every ramp with the fixed batch
sizes beside it (`cbs.analysis.studies.payoff`: seed intervals, step saving at equal examples).
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from cbs import commands
from cbs.results import paths
from cbs.runtime import cli, distributed, preemption
from cbs.sweeps import launch, ramps

__all__ = ["main", "run"]

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config with `sweep` and `ramps`.",
                                          lock_config=False)
_SWEEP_DIR = flags.DEFINE_string("sweep_dir", None, "Sweep directory.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Directory of the ramps and their report "
                               "(default: the sweep directory).")
flags.mark_flags_as_required(["config", "sweep_dir"])
flags.adopt_module_key_flags(distributed)  # --distributed, --coordinator_address, ...


def main(argv: list[str]) -> None:
    del argv
    sweep_dir, out_dir = cli.required(_SWEEP_DIR), _OUT_DIR.value
    distributed.from_flags()  # a multi-host slice or Slurm step joins up; else one process
    launch.check_config(_CONFIG.value)  # the sweep, then the ramps: before anything is written
    ramps.check_ramps(_CONFIG.value, sweep_dir)
    with preemption.active():
        launch.run_sweep(_CONFIG.value, sweep_dir)
        runs = ramps.run_ramps(_CONFIG.value, sweep_dir, out_dir=out_dir or sweep_dir)
    # scipy and matplotlib load only when a report is written
    from cbs.analysis.reports import report, report_tables
    from cbs.analysis.studies import payoff

    if out_dir and out_dir != sweep_dir:
        path = payoff.write_report(out_dir, runs, _CONFIG.value.sweep.targets,
                                   sweep_dir=sweep_dir)
        print(paths.read_text(path))
        return
    path = report.write_report(sweep_dir)
    analysis = report.load_analysis(sweep_dir)
    print(report_tables.ramp_table(report.read_ramps(sweep_dir), analysis))
    print(f"report: {path}")


def run() -> None:
    """The `cbs-ramps` console script (and `python -m experiments.ramps`)."""
    commands.make_configs_importable()
    cli.run(main, outputs=("sweep_dir", "out_dir"))


if __name__ == "__main__":
    run()
