"""An adaptive batch ramp on digits: B follows the live gradient noise scale.

    cbs-train --config=ramp_adaptive --workdir=/tmp/ad

Every 10 steps the loop reads the in-step live estimate of B_simple (exact, from the step's
per-example gradient norms; EMA of numerator and denominator,
`cbs.stats.smoothing.NoiseScaleEMA`) and the schedule (`cbs.engine.adaptive.Adaptive`)
moves B on the ladder 16, 32, ..., 1024 towards k·B_simple, with hysteresis (the target must
stay beyond a band of factor^¾ for 3 consecutive readings). Adam's η follows the
square-root rule from η_0 at B_0 = 16. Expected: B climbs from 16 to a few hundred as the
loss falls (B_simple grows from ~30 to ~100+ on this task).

`:calibrated` targets the calibrated prediction of B_crit instead (`rule="calibrated"`:
k·r̂·B_simple with Adam's r̂ = 1.34 from the shipped calibration), the number each train
record logs as `advice/b_crit`.
"""

from __future__ import annotations

from cbs.configs import base, digits_ramp_base

__all__ = [
    "SCHEDULE", "get_config",
]

SCHEDULE = {"kind": "adaptive", "min_batch": 16, "max_batch": 1024, "initial": 16,
            "factor": 2, "k": 1.0, "patience": 3, "source": "b_simple", "multiple": 16}


def get_config(arg: str = ""):
    words = base.parse_arg(arg, ("tiny", "calibrated"))
    schedule = SCHEDULE | ({"rule": "calibrated"} if "calibrated" in words else {})
    c = digits_ramp_base.digits_ramp(",".join(sorted(words - {"calibrated"})), schedule,
                                     base_batch_size=16, learning_rate=4e-3)
    c.batch.adapt_every = 10  # steps between noise-scale readings
    return c
