"""Local critical batch size by branched training, then its table and figure.

    cbs-branch --config=digits_branch \
        --workdir=runs/digits_branch --sweep_dir=runs/digits
    cbs-branch --config=... --workdir=DIR --shard=2/4 --noreport  # array job
    cbs-branch --analyze_only --workdir=results/digits_branch \
        --sweep_dir=runs/digits  # table, report.md and figure from committed records

Trains (or resumes) the reference run, then this shard's branch units (`cbs.sweeps.branches`;
finished units are skipped). With --report (default, not for shards) prints the table of B*
per branch point and writes workdir/report.md and local_cbs.png (with --sweep_dir's B_crit).
"""

from __future__ import annotations

import time

from absl import flags
from ml_collections import config_flags

from cbs import commands
from cbs.runtime import cli, distributed, preemption
from cbs.sweeps import branches

__all__ = ["main", "run"]

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (path[:arg]) with a "
                                          "`branch` section.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Study directory (reference run, records).")
_SWEEP_DIR = flags.DEFINE_string("sweep_dir", None, "Sweep of the same model (optional): its "
                                 "B_crit per target goes into the figure.")
_SHARD = flags.DEFINE_string("shard", None, "Run only this shard of the branch units: i/n, "
                             "or auto (this host's index in its TPU slice or Slurm step).")
_REPORT = flags.DEFINE_bool("report", True, "Print the table and write the figure.")
_FIGURE = flags.DEFINE_string("figure", None, "Figure path (default workdir/local_cbs.png).")
_ANALYZE_ONLY = flags.DEFINE_bool("analyze_only", False, "Only the report and figure, from the "
                                  "records in --workdir (no config, nothing trained).")
flags.mark_flags_as_required(["workdir"])
flags.adopt_module_key_flags(distributed)  # --distributed, --coordinator_address, ...


def main(argv: list[str]) -> None:
    del argv
    start = time.perf_counter()
    if not _ANALYZE_ONLY.value:
        if _CONFIG.value is None:
            raise ValueError("--config is required unless --analyze_only")
        shard = distributed.from_flags(_SHARD.value)  # a multi-host slice or Slurm step joins
        with preemption.active():
            branches.run_branches(_CONFIG.value, cli.required(_WORKDIR), shard=shard)
        print(f"reference and branches done in {time.perf_counter() - start:.0f} s")
    if _ANALYZE_ONLY.value or (_REPORT.value and not _SHARD.value):
        # scipy and matplotlib load only when a report is written
        from cbs.analysis.reports import branch_report

        print(branch_report.write_report(cli.required(_WORKDIR), sweep_dir=_SWEEP_DIR.value))
        path = branch_report.plot_local_cbs(cli.required(_WORKDIR), sweep_dir=_SWEEP_DIR.value,
                                            path=_FIGURE.value)
        print(f"figure: {path}  (total {time.perf_counter() - start:.0f} s)")


def run() -> None:
    """The `cbs-branch` console script (and `python -m experiments.branch`)."""
    commands.make_configs_importable()
    cli.run(main, outputs=("workdir",))


if __name__ == "__main__":
    run()
