"""Run a batch-size sweep, then (by default) fit it and write the report.

    cbs-sweep --config=digits_sweep --sweep_dir=runs/digits
    cbs-sweep --config=...:tiny --sweep_dir=/tmp/s --config.sweep.seeds=0,1
    cbs-sweep --config=... --sweep_dir=DIR --shard=3/8 --noanalyze  # array job

The config is validated before anything is written. Re-running the command skips finished
trials and resumes unfinished ones; with --shard=i/n only the batch sizes whose rank is ≡ i
(mod n) run, so n copies (Slurm array, Kubernetes indexed job, ...) cover the sweep with an
unsharded run's records; run `cbs-analyze` once all are done. --shard=auto --distributed=off
runs one shard per host of a TPU slice or task of a Slurm step (`cbs.runtime.distributed`).
Launchers on one directory share its groups of trials. Files: `cbs.results.store`.
"""

from __future__ import annotations

import os
import time

from absl import flags
from ml_collections import config_flags

from cbs import commands
from cbs.runtime import cli, distributed, preemption
from cbs.sweeps import grid, launch

__all__ = ["main", "run"]

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (path[:arg]) with a "
                                          "`sweep` section.", lock_config=True)
_SWEEP_DIR = flags.DEFINE_string("sweep_dir", None, "Sweep directory (records, checkpoints).")
_SHARD = flags.DEFINE_string("shard", None, "Run only this shard of the trials: i/n, or "
                             "auto (this host's index in its TPU slice or Slurm step).")
_ANALYZE = flags.DEFINE_bool("analyze", True, "Fit and write the report after the trials "
                             "(needs every trial finished; off for shards).")
_BOOTSTRAP = flags.DEFINE_integer("bootstrap", 1000, "Bootstrap resamples of each fit.")
_REDEFINE = flags.DEFINE_bool("redefine", False, "Accept a changed grid (batch sizes, learning "
                              "rates, seeds, extension rules) for an existing --sweep_dir; "
                              "finished trials still in the grid are kept.")
flags.mark_flags_as_required(["config", "sweep_dir"])
flags.adopt_module_key_flags(distributed)  # --distributed, --coordinator_address, ...


def main(argv: list[str]) -> None:
    del argv
    shard = distributed.from_flags(_SHARD.value)  # a multi-host slice or Slurm step joins
    grid.parse_shard(shard)  # a bad --shard stops before anything is written
    start = time.perf_counter()
    with preemption.active():
        launch.run_sweep(_CONFIG.value, cli.required(_SWEEP_DIR), shard=shard,
                         redefine=_REDEFINE.value)
    print(f"trials done in {time.perf_counter() - start:.0f} s")
    if _ANALYZE.value and not _SHARD.value:
        # scipy and matplotlib load only when a report is written
        from cbs.analysis.reports import report, report_tables

        sweep_dir = cli.required(_SWEEP_DIR)
        path = report.write_report(sweep_dir, bootstrap=_BOOTSTRAP.value)
        analysis = report.load_analysis(sweep_dir)
        print(report_tables.summary_table(analysis))
        if _CONFIG.value.train.get("wandb"):  # the trials' runs are in W&B: so is the table
            report_tables.to_wandb(analysis, _CONFIG.value.train.wandb, group=os.path.basename(
                os.path.normpath(str(sweep_dir))))
        print(f"report: {path}  (total {time.perf_counter() - start:.0f} s)")


def run() -> None:
    """The `cbs-sweep` console script (and `python -m experiments.sweep`)."""
    commands.make_configs_importable()
    cli.run(main, outputs=("sweep_dir",))


if __name__ == "__main__":
    run()
