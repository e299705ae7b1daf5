"""`cbs.schedules`: the public API of `cbs.engine.schedules`, re-exported.

Batch-size schedules, learning-rate coupling and learning-rate schedules in examples seen.
"""

from cbs.engine.schedules import (  # noqa: F401
    LR_RULES,
    Adaptive,
    AdaptiveState,
    Constant,
    Linear,
    Step,
    batch_schedule_from_config,
    batch_size_trace,
    coupled_lr,
    coupled_lr_history,
    deepseek_v3_schedule,
    in_sequences,
    llama3_schedule,
    lr_multiplier,
    lr_schedule,
    lr_schedule_from_config,
    register,
)
