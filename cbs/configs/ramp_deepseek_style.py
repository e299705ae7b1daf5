"""A DeepSeek-V3 style batch ramp, scaled down to digits: B grows linearly, then holds.

    cbs-train --config=ramp_deepseek_style --workdir=/tmp/ds

DeepSeek-V3 ramped its batch from 3,072 to 15,360 sequences (5×) over the first 469B of
14.8T training tokens (`cbs.engine.schedules.deepseek_v3_schedule`, full scale as a pure function).
Here: 32 → 160 examples (5×) over the first 4,000 examples, rounded to multiples of the
micro-batch 16 (so at most 9 accumulation counts, one compilation each), with Adam's η
coupled by the square-root rule from η_0 at B_0 = 32. Expected: full_train/loss ≈ 0.05
within about 200 steps.
"""

from __future__ import annotations

from cbs.configs import digits_ramp_base

__all__ = [
    "SCHEDULE", "get_config",
]

SCHEDULE = {"kind": "linear", "start": 32, "end": 160, "over": 4_000, "multiple": 16}


def get_config(arg: str = ""):
    c = digits_ramp_base.digits_ramp(arg, SCHEDULE, base_batch_size=32, learning_rate=5e-3)
    return c
