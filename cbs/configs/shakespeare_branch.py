"""Local critical batch size of the character-level Transformer of shakespeare_sweep.py.

    cbs-branch --config=shakespeare_branch \
        --workdir=runs/shakespeare_branch --sweep_dir=runs/shakespeare
    cbs-branch --config=shakespeare_branch:tiny --workdir=/tmp/b

Branches at k = 1 ... 16 with η = √k·η_0, three seeds, otherwise the paper's rules (Merrill et
al. 2025, Sec. 3.1; `default_branch_config`). The LM case is where the paper found B_simple far
below the local CBS. Three branch points fit the study in ≈ 30 minutes (1487 s on 2 shared CPU
cores; results/shakespeare_branch/). `:tiny` runs in seconds.
"""

from __future__ import annotations

from cbs.configs import base, shakespeare_sweep
from cbs.sweeps.branch_config import default_branch_config

__all__ = ["get_config"]


def get_config(arg: str = ""):
    c = shakespeare_sweep.get_config("")
    del c["sweep"]
    c.optim.learning_rate = 1.5e-3  # η_0 at B = 16 (3e-3·(16/64)^½)
    c.batch.schedule.batch_size = 16  # B, windows per update
    c.batch.micro_batch = 16  # m = B
    c.train.max_steps = 2000  # 32k windows
    c.train.log_every = 50  # read metrics every 50 steps
    c.train.checkpoint_every = 50  # branch points are checkpoints
    c.train.progress_bar = False  # quiet
    c.eval.every = 100  # eval-split loss every 100 steps
    c.noise.every = 100  # exact B_simple every 100 steps
    c.noise.batch_size = 16  # on the step's 16 windows (at most the batch)

    b = c.branch = default_branch_config()
    b.points_examples = (800, 8000, 31_000)  # windows seen at the branches (three: 30 min)
    b.ks = (1, 2, 4, 8, 16)  # branch batches 16 ... 256
    b.window_examples = 8192  # Δ: 512 steps at k = 1 (the paper's ≈ 477), 32 at k = 16
    if "tiny" in base.parse_arg(arg):
        c.model.d_model = 32  # narrower
        c.model.d_ff = 64  # narrower MLP
        c.train.max_steps = 40  # 640 windows
        c.train.checkpoint_every = 20  # two checkpoints
        c.eval.every = 20  # two evaluations
        c.eval.num_examples = 64  # small evaluation
        c.noise.every = 20  # two measurements
        b.points_examples = (320,)  # one point
        b.ks = (1, 2, 4)  # three multipliers
        b.window_examples = 128  # 8 steps at k = 1
        b.seeds = (1, 2)  # two seeds
    return c
