"""`cbs.train`: the public API of `cbs.engine.trainer` (a run from a config),
`cbs.engine.loop` (the one training loop), `cbs.engine.parts` (the parts of a run) and the
state and step of `cbs.engine.step`, re-exported: `__all__` is the union of theirs.

Training runs from a config: set-up (`RunParts`), the loop, evaluation, checkpoints, records,
resume.
"""

from cbs.engine.loop import ENDED, DivergedError, Loop, StopFn, config_hash, ended_run
from cbs.engine.measure import Measurement
from cbs.engine.parts import RunParts
from cbs.engine.step import TrainState, TrainStep, init_train_state
from cbs.engine.trainer import EvalFn, Trainer, run

__all__ = [
    "ENDED", "DivergedError", "EvalFn", "Loop", "Measurement", "RunParts", "StopFn", "TrainState",
    "TrainStep", "Trainer", "config_hash", "ended_run", "init_train_state", "run",
]
