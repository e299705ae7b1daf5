"""A DeepSeek-V3 style batch ramp, scaled down to digits: B grows linearly, then holds.

    python -m experiments.main --config=experiments/configs/ramp_deepseek_style.py --workdir=/tmp/ds

DeepSeek-V3 ramped its batch from 3,072 to 15,360 sequences (5×) over the first 469B of
14.8T training tokens (`cbs.schedules.deepseek_v3_schedule`, full scale as a pure function).
Here: 32 → 160 examples (5×) over the first 4,000 examples, rounded to multiples of the
micro-batch 16 (so at most 9 accumulation counts, one compilation each), with Adam's η
coupled by the square-root rule from η_0 at B_0 = 32. Expected: full_train/loss ≈ 0.05
within about 200 steps.
"""

from __future__ import annotations

from experiments.configs import base, digits_sweep

SCHEDULE = {"kind": "linear", "start": 32, "end": 160, "over": 4_000, "multiple": 16}


def get_config(arg: str = ""):
    c = digits_sweep.get_config(arg)
    del c["sweep"]
    c.batch.micro_batch = 16  # m fixed; B changes through the accumulation count
    c.batch.schedule = base.schedule_config(SCHEDULE)  # the linear ramp above
    c.batch.lr_coupling.rule = "sqrt"  # η = η_0·(B/B_0)^½
    c.batch.lr_coupling.base_batch_size = 32  # B_0, the first batch size
    c.batch.lr_coupling.cap = 0.03  # largest η allowed
    c.optim.learning_rate = 5e-3  # η_0 at B_0
    c.train.max_steps = 2000  # updates
    c.eval.every = 10  # evaluations every 10 steps
    c.noise.every = 50  # exact noise statistics every 50 steps
    return c
