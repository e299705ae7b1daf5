"""Train one run from a config file: cbs-train --config=... --workdir=DIR.

    cbs-train --config=digits_mlp:tiny \
        --workdir=/tmp/digits --config.optim.learning_rate=3e-3

The same command resumes from the latest checkpoint in --workdir (an ended run prints its
summary again). Several hosts: the same command on each; on a TPU pod slice, under Slurm or
Open MPI the processes find each other (`cbs.runtime.distributed`), elsewhere add
--coordinator_address=HOST:PORT --num_processes=N --process_id=I; --distributed=off keeps
each on its own (docs/scaling.md). Records: `cbs.engine.trainer`. Exit status 1 when the run
diverged, 143 after SIGTERM and 130 after Ctrl-C (a checkpoint saved: rerun to resume).
"""

from __future__ import annotations

import json
import sys

import jax
from absl import flags
from ml_collections import config_flags

from cbs import commands
from cbs.engine import loop, trainer
from cbs.runtime import cli, distributed, preemption

__all__ = ["main", "run"]

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (path[:arg]).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (records, checkpoints).")
flags.mark_flags_as_required(["config", "workdir"])
flags.adopt_module_key_flags(distributed)  # --distributed, --coordinator_address, ...


def main(argv: list[str]) -> None:
    del argv
    distributed.from_flags()
    try:
        with preemption.active():
            summary = trainer.run(_CONFIG.value, cli.required(_WORKDIR))
    except loop.DivergedError as err:
        print(f"diverged: {err}", file=sys.stderr)
        sys.exit(1)
    if jax.process_index() == 0:
        keep = ("status", "step", "examples_seen", "last_eval", "elapsed_s")
        print(json.dumps({k: summary[k] for k in keep}, indent=1))


def run() -> None:
    """The `cbs-train` console script (and `python -m experiments.main`)."""
    commands.make_configs_importable()
    cli.run(main, outputs=("workdir",))


if __name__ == "__main__":
    run()
