"""Local critical batch size of the digits MLP (the model of digits_sweep.py) with Adam.

    cbs-sweep --config=digits_sweep --sweep_dir=runs/digits
    cbs-branch --config=digits_branch --workdir=runs/digits_branch --sweep_dir=runs/digits
    cbs-branch --config=digits_branch:tiny --workdir=/tmp/b

The branch points lie where the sweep's targets L = 0.5 ... 0.05 are crossed; B* = k*·B by the
paper's criterion. Expected on 2 CPU cores: a few minutes; B* rises from the ladder's floor
(≤ 4) to tens.

Departures from the paper's rules (`default_branch_config`, Merrill et al. 2025, Sec. 3.1):
- compared loss: the exact training-set loss at the window's end (`metric`), not the EMA of
  the batch loss: a batch of 4 digits is far noisier than the paper's 4M tokens;
- ε = 2% of the loss (`tolerance="relative"`), not 0.01 nats: digits' loss falls below 0.01,
  where 0.01 nats would accept every k (the paper's is ≈ 0.4% of OLMo's loss of ≈ 2.6);
- Δ proportional to the examples seen (`window_fraction`): a fixed 4096 examples was 10× the
  training before the first point; the paper's Δ is short against its branch points.
`:tiny` shrinks everything to seconds (tests, notebook).
"""

from __future__ import annotations

from cbs.configs import base
from cbs.sweeps.branch_config import default_branch_config

__all__ = ["get_config"]


def get_config(arg: str = ""):
    c = base.base_config("digits", "mlp")
    c.model.hidden_sizes = (128, 128)  # 64-128-128-10, as digits_sweep.py
    c.optim.name = "adam"  # Adam, constant learning rate
    c.optim.learning_rate = 2e-3  # η_0 at B = 4 (2 × 4e-3·(4/64)^½: among the sweep's best)
    c.batch.schedule.batch_size = 4  # B, the reference batch
    c.batch.micro_batch = 4  # m = B: branch k runs k accumulation steps of B
    c.train.max_steps = 4096  # 16k examples
    c.train.log_every = 100  # read metrics every 100 steps
    c.train.checkpoint_every = 64  # branch points are checkpoints (every 256 examples)
    c.train.progress_bar = False  # quiet
    c.eval.every = 64  # full training-set loss every 64 steps (sweep-target crossings)
    c.eval.batch_size = 2048  # the whole training set in one chunk
    c.noise.every = 0  # no in-run measurement (same-batch H); see branch.noise_checkpoints

    b = c.branch = default_branch_config()
    b.points_examples = (1024, 1536, 2048, 3072, 4096, 6144, 8192, 12_288, 16_384)  # E
    b.ks = (1, 2, 4, 8, 16, 32, 64)  # branch batches 4 ... 256
    b.window_fraction = 0.25  # Δ = E/4 (a multiple of 64·4 examples at every point)
    b.metric = "full_train/loss"  # exact loss over the 1438 training examples
    b.tolerance = "relative"  # ε as a fraction of the loss
    b.epsilon = 0.02  # 2%
    b.noise_checkpoints = 24  # exact B_simple/B_noise at 24 log-spaced checkpoints + points
    if "tiny" in base.parse_arg(arg):
        c.train.max_steps = 60  # 240 examples
        c.train.checkpoint_every = 20  # three checkpoints
        c.eval.every = 20  # three evaluations
        b.points_examples = (80, 160)  # two points
        b.ks = (1, 2, 4)  # three multipliers
        b.window_fraction = 0.0  # a fixed window ...
        b.window_examples = 64  # ... of 16 steps at k = 1
        b.seeds = (1, 2)  # two seeds
        b.noise_checkpoints = 2  # two measurements besides the points
        b.noise.deviations = 16  # on 16 deviations
    return c
