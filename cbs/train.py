"""`cbs.train`, training runs from a config, re-exports `cbs.engine.trainer` (a run),
`cbs.engine.loop` (the training loop), `cbs.engine.parts` (`RunParts`), `cbs.engine.state`,
`cbs.engine.step` and `cbs.engine.noise_spec` (the noise section's spec)."""

from cbs.engine.loop import (
    ENDED,
    DivergedError,
    Loop,
    StopFn,
    config_hash,
    ended_run,
    noise_scale,
)
from cbs.engine.noise_spec import (
    AUTO_METHOD,
    EXAMPLES,
    FULL_DATA_MAX,
    FULL_DATA_METHOD,
    NoiseSpec,
)
from cbs.engine.parts import RunParts
from cbs.engine.state import (
    COUNT_BASE,
    StatefulLoss,
    StepMetrics,
    TrainState,
    count_add,
    count_from_int,
    count_int32,
    count_to_int,
    count_value,
    init_train_state,
    position,
    stateless,
)
from cbs.engine.step import (
    BatchLayout,
    MeasureHook,
    StepOptions,
    TrainStep,
    apply_step,
    jit_step,
)
from cbs.engine.trainer import CHECKPOINT_CHUNK, EvalFn, Trainer, measure_checkpoint, run

__all__ = [
    "AUTO_METHOD", "CHECKPOINT_CHUNK", "COUNT_BASE", "ENDED", "EXAMPLES", "FULL_DATA_MAX",
    "FULL_DATA_METHOD", "BatchLayout", "DivergedError", "EvalFn", "Loop", "MeasureHook",
    "NoiseSpec", "RunParts", "StatefulLoss", "StepMetrics", "StepOptions", "StopFn",
    "TrainState", "TrainStep", "Trainer", "apply_step", "config_hash", "count_add",
    "count_from_int", "count_int32", "count_to_int", "count_value", "ended_run",
    "init_train_state", "jit_step", "measure_checkpoint", "noise_scale", "position", "run",
    "stateless",
]
