"""`cbs.schedules` re-exports `cbs.engine.schedules` (batch-size schedules in examples seen),
`cbs.engine.adaptive` (the adaptive one) and `cbs.engine.lr` (learning-rate coupling and
schedules)."""

from cbs.engine.adaptive import ADAPTIVE_RULES, Adaptive, AdaptiveState
from cbs.engine.lr import (
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
    step_rate,
    validate_coupling_config,
)
from cbs.engine.schedules import (
    BatchSchedule,
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

__all__ = [
    "ADAPTIVE_RULES", "DECAYS", "EXPONENTS", "LR_RULES", "Adaptive", "AdaptiveState",
    "BatchSchedule", "Constant", "Linear", "Step", "batch_schedule_from_config",
    "batch_size_trace", "checked_schedule", "coupled_lr", "coupled_lr_history",
    "coupling_from_config", "deepseek_v3_schedule", "in_sequences", "learning_rate_shape",
    "llama3_schedule", "lr_multiplier", "lr_schedule", "lr_schedule_from_config", "register",
    "step_rate", "validate_batch_config", "validate_coupling_config",
]
