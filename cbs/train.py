"""`cbs.train`: the public API of `cbs.engine.trainer` (a run from a config),
`cbs.engine.loop` (the one training loop), `cbs.engine.parts` (the parts of a run), the state
and step of `cbs.engine.step` and the noise measurement's spec (`cbs.engine.noise_spec`),
re-exported: `__all__` is the union of theirs.

Training runs from a config: set-up (`RunParts`), the loop, evaluation, checkpoints, records,
resume.
"""

from cbs.engine.loop import ENDED, DivergedError, Loop, StopFn, config_hash, ended_run
from cbs.engine.noise_spec import (
    AUTO_METHOD,
    EXAMPLES,
    FULL_DATA_MAX,
    FULL_DATA_METHOD,
    NoiseSpec,
    validate_config,
)
from cbs.engine.parts import RunParts
from cbs.engine.step import StatefulLoss, TrainState, TrainStep, init_train_state, stateless
from cbs.engine.trainer import CHECKPOINT_CHUNK, EvalFn, Trainer, measure_checkpoint, run

__all__ = [
    "AUTO_METHOD", "CHECKPOINT_CHUNK", "ENDED", "EXAMPLES", "FULL_DATA_MAX", "FULL_DATA_METHOD",
    "DivergedError", "EvalFn", "Loop", "NoiseSpec", "RunParts", "StatefulLoss", "StopFn",
    "TrainState", "TrainStep", "Trainer", "config_hash", "ended_run", "init_train_state",
    "measure_checkpoint", "run", "stateless", "validate_config",
]
