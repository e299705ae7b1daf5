"""`cbs.schedules`: the public API of `cbs.engine.schedules` and `cbs.engine.lr`, re-exported.

Batch-size schedules, learning-rate coupling and learning-rate schedules in examples seen.
"""

from cbs.engine.lr import (  # noqa: F401
    DECAYS,
    EXPONENTS,
    LR_RULES,
    coupled_lr,
    coupled_lr_history,
    coupling_from_config,
    learning_rate_shape,
    lr_multiplier,
    lr_schedule,
    lr_schedule_from_config,
    validate_coupling_config,
)
from cbs.engine.schedules import (  # noqa: F401
    Adaptive,
    AdaptiveState,
    Constant,
    Linear,
    Step,
    batch_schedule_from_config,
    batch_size_trace,
    checked_schedule,
    deepseek_v3_schedule,
    in_sequences,
    llama3_schedule,
    register,
    validate_batch_config,
)
