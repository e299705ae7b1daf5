"""A Llama 3 style batch ramp, scaled down to digits: B doubles twice at example thresholds.

    cbs-train --config=ramp_llama3_style --workdir=/tmp/l3

Llama 3 405B stepped its batch 4M → 8M tokens after 252M tokens → 16M after 2.87T tokens
(`cbs.engine.schedules.llama3_schedule`, the full-scale shape as a pure function). Here the same
shape (two doublings) is placed where the digits sweep's fitted B_crit passes the current
batch: 32 examples, 64 after 1,500 examples, 128 after 4,000; the micro-batch stays 16, so
only the accumulation count changes (1 compilation per count: 2, 4, 8). Adam's η is coupled
by the square-root rule, η = η_0·(B/32)^½ (OLMo's batch-size warmup multiplied it by √2 per
doubling). Expected: full_train/loss ≈ 0.05 within about 200 steps; the run is one of the
points on the S–E plane of the `digits_ramps` preset.
"""

from __future__ import annotations

from cbs.configs import digits_ramp_base

__all__ = [
    "SCHEDULE", "get_config",
]

SCHEDULE = {"kind": "step", "steps": ((0, 32), (1_500, 64), (4_000, 128))}


def get_config(arg: str = ""):
    c = digits_ramp_base.digits_ramp(arg, SCHEDULE, base_batch_size=32, learning_rate=5e-3)
    return c
