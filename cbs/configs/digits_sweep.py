"""The default study: batch-size sweep of a 64-128-128-10 MLP on digits with Adam.

    cbs-sweep --config=digits_sweep --sweep_dir=runs/digits
    cbs-sweep --config=digits_sweep:tiny --sweep_dir=/tmp/t
    cbs-sweep --config=digits_sweep:seeds3 --sweep_dir=results/digits_seeds3
    cbs-analyze --sweep_dir=results/digits_seeds3 --select_on_seed=0

The noise is measured at every evaluation on the whole training set, and after the sweep
densely along one reference run at B = 64 (`cbs.sweeps.reference`). Measured (results/digits):
48 trials (12 from extension rounds), B_crit from 41 (L = 0.5) to 232 (L = 0.05); B_noise at a
target spans up to 22× across batch sizes (8.8-192 at L = 0.05), its median 0.28-0.48 B_crit;
about 25 min on 2 shared CPU cores. `:tiny` runs 3 batch sizes for a handful of steps (tests).

`:seeds3` is the held-out study (committed: results/digits_seeds3): seeds 0, 1, 2, every rate
of a (B, seed) run until it crosses the lowest target (so S at seed 0's best rate is measured
on seeds 1 and 2, not censored); `--select_on_seed=0` then reports B_crit with each rate
selected on seed 0 and S measured on seeds 1 and 2 (`cbs.analysis.fits.held_out`). Measured:
150 trials, 21 minutes; per-seed B_crit within 1.08–1.72× of each other, every held-out
B_crit inside the in-sample interval.
"""

from __future__ import annotations

from cbs.configs import base
from cbs.sweeps.grid import default_sweep_config, default_sweep_noise

__all__ = ["get_config"]


def get_config(arg: str = ""):
    c = base.base_config("digits", "mlp")
    c.model.hidden_sizes = (128, 128)  # 64-128-128-10
    c.optim.name = "adam"  # Adam, constant learning rate (no warmup, no decay)
    c.batch.micro_batch = 1024  # m: each trial's whole batch in one micro-batch
    c.eval.batch_size = 2048  # the whole training set in one evaluation chunk
    c.train.checkpoint_every = 1000  # steps between checkpoints (engine back end)

    s = c.sweep = default_sweep_config()
    s.batch_sizes = tuple(2 ** k for k in range(2, 11))  # 4 ... 1024 examples
    s.base_lr = 4e-3  # η at B = 64, centre of the grid
    s.lr_rule = "sqrt"  # centre η(B) = base_lr·(B/64)^½ (Adam)
    s.lr_factors = (0.5, 1.0, 2.0, 4.0)  # factor-2 grid, one step below and two above
    s.max_lr = 0.1  # cap on any rate; divergence, not the cap, bounds the grid from above
    s.extend_lr_rounds = 3  # up to three factor-2 steps past an edge optimum, one per round
    s.targets = (0.5, 0.3, 0.2, 0.1, 0.05)  # full training-set cross-entropy (nats)
    s.max_examples = 400_000  # ≈ 280 epochs per trial at most
    s.max_steps = 6_000  # and at most this many updates
    s.evals_per_trial = 80  # log-spaced progress evaluations up to the budget
    n = default_sweep_noise(c.noise)  # measured at each evaluation
    n.examples = "all"  # exact G, tr(Σ), GᵀHG on all 1438 training examples
    n.deviations = 32  # tr(HΣ) from the deviations of 32 random examples
    n.hessian_batch_size = 128  # ... and the Hessian of 128 independent ones (unbiased)
    s.noise_protocol = "reference"  # also one dense run at B_ref with the full-data Hessian
    s.noise_reference_evals = 150  # its log-spaced evaluations up to the budget
    s.reference_noise.deviations = 256  # its tr(HΣ) from 256 deviations (32: std ≈ 1.4 late)
    words = base.parse_arg(arg, ("tiny", "seeds3"))
    if "seeds3" in words:  # the held-out study: every rate's S measured on every seed
        s.seeds = (0, 1, 2)  # three seeds per (B, η): rates selected on one, S on the others
        s.stop_when_dominated = False  # no rate of a (B, seed) censored by a faster one
    if "tiny" in words:
        s.batch_sizes = (8, 32, 128)  # three batch sizes
        s.lr_factors = (1.0, 2.0)  # two learning rates each
        s.targets = (1.5, 1.0)  # loose targets
        base.make_tiny_sweep(s, steps=60, evals=6)
        s.noise_protocol = "per_trial"  # no reference run (tests run it on their own)
        s.noise_reference_batch_size = 32  # a batch size of the tiny grid
        s.noise_reference_evals = 12  # a short reference run
        s.checkpoint_every_evals = 2  # exercise checkpoints
    return c
