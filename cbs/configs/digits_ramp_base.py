"""The digits sweep's run config with a batch-size schedule (shared by the ramp configs).

Not a config itself: `ramp_llama3_style.py`, `ramp_deepseek_style.py` and
`ramp_adaptive.py` call `digits_ramp` with their schedule.
"""

from __future__ import annotations

import ml_collections

from cbs.configs import base, digits_sweep


def digits_ramp(arg: str, schedule: dict, *, base_batch_size: int, learning_rate: float
                ) -> ml_collections.ConfigDict:
    """The digits sweep's run config with a batch-size schedule and square-root coupling."""
    c = digits_sweep.get_config(arg)
    del c["sweep"]
    c.batch.micro_batch = 16  # m fixed; B changes through the accumulation count
    c.batch.schedule = base.schedule_config(schedule)  # the ramp
    c.batch.lr_coupling.rule = "sqrt"  # η = η_0·(B/B_0)^½ at every change
    c.batch.lr_coupling.base_batch_size = base_batch_size  # B_0, the first batch size
    c.batch.lr_coupling.cap = 0.03  # largest η allowed (Adam diverges above)
    c.optim.learning_rate = learning_rate  # η_0 at B_0
    c.train.max_steps = 2000  # updates
    c.eval.every = 10  # evaluation (with the full training-set loss) every 10 steps
    c.noise.every = 50  # exact noise statistics every 50 steps
    c.noise.examples = "step"  # on the step's examples only, not at evaluations as the sweep
    c.noise.batch_size = 0  # one micro-batch
    c.noise.curvature = False  # B_simple only
    c.noise.deviations = c.noise.hessian_batch_size = c.noise.chunk_size = 0  # (curvature off)
    return c
