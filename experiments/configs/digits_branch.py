"""Local critical batch size of the digits MLP (the model of digits_sweep.py) with Adam.

    python -m experiments.branch --config=experiments/configs/digits_branch.py \
        --workdir=runs/digits_branch --sweep_dir=runs/digits
    python -m experiments.branch --config=experiments/configs/digits_branch.py:tiny --workdir=/tmp/b

A reference run at B = 16, η_0 = 2e-3 (the sweep's square-root rule at B = 16) for 3000 steps
(48k examples, ≈ 33 epochs), with exact B_simple and B_noise on each 20th step's batch; branches at
k = 1 ... 64 (B up to 1024) with η = √k·η_0, each for Δ = 4096 examples, from 8 log-spaced
points, three data-order seeds each. The compared loss is the EMA of the batch loss with
a relative tolerance (ε = 2% of the loss: digits' loss falls to 1e-3, where the paper's 0.01
nats would accept every k). Expected on 2 CPU cores: a few minutes; B* grows as the loss falls.
`:tiny` shrinks everything to seconds (tests, notebook).

Where this study departs from the paper's rules (`default_branch_config`, Merrill et al. 2025,
Sec. 3.1), and why: ε relative (above); Δ = 256 reference steps, not ≈ 512 (2 CPU minutes);
the EMA decays per 16 examples (0.9^k per step of branch k) rather than α = 0.5 per step, since
a batch of 16 digits is far noisier than the paper's 4M-token batches; and the README table was
made with the "ladder" criterion and the geometric-mean B*, kept here so it can be reproduced.
"""

from __future__ import annotations

from cbs.sweeps.branches import default_branch_config
from experiments.configs import base


def get_config(arg: str = ""):
    c = base.base_config("digits", "mlp")
    c.model.hidden_sizes = (128, 128)  # 64-128-128-10, as digits_sweep.py
    c.optim.name = "adam"  # Adam, constant learning rate
    c.optim.learning_rate = 2e-3  # η_0 at B = 16 (4e-3·(16/64)^½, the sweep's centre)
    c.batch.schedule.batch_size = 16  # B, the reference batch
    c.batch.micro_batch = 16  # m = B: branch k runs k accumulation steps of B
    c.train.max_steps = 3000  # 48k examples
    c.train.log_every = 50  # read metrics every 50 steps
    c.train.checkpoint_every = 25  # branch points are checkpoints (every 400 examples)
    c.train.progress_bar = False  # quiet
    c.eval.every = 25  # full training-set loss every 25 steps (sweep-target crossings)
    c.eval.batch_size = 2048  # the whole training set in one chunk
    c.noise.every = 20  # exact B_simple every 20 steps (its EMA averages ~20 of them)
    c.noise.batch_size = 16  # on the step's 16 examples (at most the batch)
    c.noise.curvature = True  # and B_noise (tr(HΣ) by per-example HVPs)
    c.noise.ema_decay = 0.95  # two-batch EMA per step

    b = c.branch = default_branch_config()
    b.points_examples = (400, 1200, 2800, 5600, 10_000, 20_000, 32_000, 44_000)  # E at branches
    b.ks = (1, 2, 4, 8, 16, 32, 64)  # branch batches 16 ... 1024
    b.lr_rule = "sqrt"  # Adam
    b.window_examples = 4096  # Δ: 256 steps at k = 1, 4 at k = 64
    b.tolerance = "relative"  # ε as a fraction of the loss
    b.epsilon = 0.02  # 2%
    b.loss_ema_decay = 0.9  # EMA decay per 16 examples ...
    b.loss_ema_per = "reference_batch"  # ... so 0.9^k per step of branch k (paper: 0.5/step)
    b.criterion = "ladder"  # the first failing k ends the ladder (as in the README table)
    b.b_star = "geometric"  # B* = √(k*·k⁺)·B (as in the README table; paper: k*·B)
    b.seeds = (1, 2, 3)  # data-order seeds
    if "tiny" in base.parse_arg(arg):
        c.train.max_steps = 60  # 960 examples
        c.train.checkpoint_every = 20  # three checkpoints
        c.eval.every = 20  # three evaluations
        b.points_examples = (320, 640)  # two points
        b.ks = (1, 2, 4)  # three multipliers
        b.window_examples = 256  # 16 steps at k = 1
        b.seeds = (1, 2)  # two seeds
    return c
