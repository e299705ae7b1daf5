"""Batch-size sweep of a 40-256-256-10 MLP on MNIST-1D with Adam (a second task for the
cross-study comparison, `cbs-compare`).

    cbs-sweep --config=mnist1d_sweep --sweep_dir=results/mnist1d_adam
    cbs-sweep --config=mnist1d_sweep:sgd --sweep_dir=results/mnist1d_sgd

Needs the `[mnist1d]` extra (4,000 training signals of 40 samples, 10 classes, generated
offline). `:sgd`: plain SGD on the linear rule. The targets reach 0.1 because the MLP
memorises the training set; the noise is exact at each best trial's crossing (no reference
run: the full-data Hessian took ≈ 30 s per evaluation). `:tiny` shrinks it for tests.
"""

from __future__ import annotations

from cbs.configs import base
from cbs.sweeps.grid import default_sweep_config, default_sweep_noise

__all__ = ["get_config"]


def get_config(arg: str = ""):
    words = base.parse_arg(arg, known=("tiny", "sgd"))
    c = base.base_config("mnist1d", "mlp")
    c.model.hidden_sizes = (256, 256)  # 40-256-256-10
    c.optim.name = "adam"  # Adam, constant learning rate (no warmup, no decay)
    c.batch.micro_batch = 2048  # m: each trial's whole batch in one micro-batch
    c.eval.batch_size = 4000  # the whole training set in one evaluation chunk
    c.train.checkpoint_every = 1000  # steps between checkpoints (engine back end)

    s = c.sweep = default_sweep_config()
    s.batch_sizes = tuple(2 ** k for k in range(3, 12))  # 8 ... 2048 examples
    s.base_lr = 2e-3  # η at B = 128, centre of the grid
    s.base_batch_size = 128  # B at which base_lr is the centre
    s.lr_rule = "sqrt"  # centre η(B) = base_lr·(B/128)^½ (Adam)
    s.lr_factors = (0.5, 1.0, 2.0, 4.0)  # factor-2 grid, one step below and two above
    s.max_lr = 0.05  # cap on any rate
    s.extend_lr_rounds = 3  # up to three factor-2 steps past an edge optimum
    s.targets = (1.5, 1.0, 0.5, 0.2, 0.1)  # full training-set cross-entropy (nats)
    s.max_examples = 1_600_000  # 400 epochs per trial at most
    s.max_steps = 16_000  # and at most this many updates
    s.evals_per_trial = 80  # log-spaced progress evaluations up to the budget
    n = default_sweep_noise(c.noise)  # measured at each evaluation
    n.examples = "all"  # exact G, tr(Σ), GᵀHG on all 4000 training examples
    n.deviations = 32  # tr(HΣ) from the deviations of 32 random examples
    n.hessian_batch_size = 128  # ... and the Hessian of 128 independent ones (unbiased)
    if "sgd" in words:
        c.optim.name = "sgd"  # plain SGD: u = g, no momentum
        s.base_lr = 0.1  # η at B = 128
        s.lr_rule = "linear"  # centre η(B) = base_lr·(B/128) (SGD)
        s.lr_factors = (0.5, 1.0, 2.0)  # factor-2 grid around the centre
        s.max_lr = 2.0  # SGD above this diverges on this model
        s.extend_lr_rounds = 5  # up to five factor-2 steps past an edge optimum
    if "tiny" in words:
        s.batch_sizes = (8, 32, 128)  # three batch sizes
        s.lr_factors = (1.0, 2.0)  # two learning rates each
        s.targets = (2.2, 2.0)  # loose targets
        base.make_tiny_sweep(s, steps=60, evals=6)
    return c
