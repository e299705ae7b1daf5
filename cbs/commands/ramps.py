"""Batch-size ramps beside a sweep: python -m experiments.ramps --config=... --sweep_dir=DIR.

Finishes the sweep of the config in DIR if needed (finished trials are skipped), runs every
`config.ramps` entry not yet recorded in DIR/ramps.jsonl (`cbs.sweeps.ramps`), and rewrites the
report with the ramps on each target's S–E frontier.

With --out_dir=OUT the ramps and their records go to OUT instead and the sweep's directory
is only read; when the runs are repeated over seeds (config.ramps entries with `name` and
`seed`), OUT/payoff.md compares every ramp with the fixed batch sizes run beside it
(`cbs.analysis.payoff`): steps and examples with seed intervals, and the step saving at equal
examples against their frontier.
"""

from __future__ import annotations

import pathlib

from absl import flags, logging
from ml_collections import config_flags

from cbs import commands
from cbs.analysis import payoff, report
from cbs.engine import cli
from cbs.sweeps import launch, ramps

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config with `sweep` and `ramps`.",
                                          lock_config=False)
_SWEEP_DIR = flags.DEFINE_string("sweep_dir", None, "Sweep directory.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Directory of the ramps and their report "
                               "(default: the sweep directory).")
flags.mark_flags_as_required(["config", "sweep_dir"])


def main(argv: list[str]) -> None:
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    launch.run_sweep(_CONFIG.value, _SWEEP_DIR.value)
    if _OUT_DIR.value and _OUT_DIR.value != _SWEEP_DIR.value:
        runs = ramps.run_ramps(_CONFIG.value, _SWEEP_DIR.value, out_dir=_OUT_DIR.value)
        path = payoff.write_report(_OUT_DIR.value, runs, _CONFIG.value.sweep.targets,
                                   sweep_dir=_SWEEP_DIR.value)
        print(pathlib.Path(path).read_text())
        return
    ramps.run_ramps(_CONFIG.value, _SWEEP_DIR.value)
    path = report.write_report(_SWEEP_DIR.value)
    analysis = report.load_analysis(_SWEEP_DIR.value)
    print(report.ramp_table(report.read_ramps(_SWEEP_DIR.value), analysis))
    print(f"report: {path}")


def run() -> None:
    """The `cbs-ramps` console script (and `python -m experiments.ramps`)."""
    commands.make_configs_importable()
    cli.run(main, outputs=("sweep_dir", "out_dir"))


if __name__ == "__main__":
    run()
