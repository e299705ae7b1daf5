"""Batch-size ramps beside a sweep: python -m experiments.ramps --config=... --sweep_dir=DIR.

Finishes the sweep of the config in DIR if needed (finished trials are skipped), runs every
`config.ramps` entry not yet recorded in DIR/ramps.jsonl (`cbs.sweeps.ramps`), and rewrites the
report with the ramps on each target's S–E frontier.
"""

from __future__ import annotations

from absl import flags, logging
from ml_collections import config_flags

from cbs import commands
from cbs.analysis import report
from cbs.engine import cli
from cbs.sweeps import launch, ramps

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config with `sweep` and `ramps`.",
                                          lock_config=False)
_SWEEP_DIR = flags.DEFINE_string("sweep_dir", None, "Sweep directory.")
flags.mark_flags_as_required(["config", "sweep_dir"])


def main(argv: list[str]) -> None:
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    launch.run_sweep(_CONFIG.value, cli.required(_SWEEP_DIR))
    ramps.run_ramps(_CONFIG.value, cli.required(_SWEEP_DIR))
    path = report.write_report(cli.required(_SWEEP_DIR))
    analysis = report.load_analysis(cli.required(_SWEEP_DIR))
    print(report.ramp_table(report.read_ramps(cli.required(_SWEEP_DIR)), analysis))
    print(f"report: {path}")


def run() -> None:
    """The `cbs-ramps` console script (and `python -m experiments.ramps`)."""
    commands.make_configs_importable()
    cli.run(main, outputs=("sweep_dir",))


if __name__ == "__main__":
    run()
