"""`cbs.train`: the public API of `cbs.engine.trainer`, re-exported.

Training runs from a config: set-up (`RunParts`), the loop, evaluation, checkpoints, records,
resume.
"""

from cbs.engine.trainer import (  # noqa: F401
    ENDED,
    DivergedError,
    EvalFn,
    Loop,
    NoiseSpec,
    RunParts,
    Trainer,
    TrainState,
    TrainStep,
    config_hash,
    init_train_state,
    run,
)
