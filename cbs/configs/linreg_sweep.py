"""Batch-size sweep of plain SGD on Gaussian linear regression: the anchor of the cross-task
comparison, where the noise scales are known in closed form (`cbs.data.linreg_noise_stats`).

    cbs-sweep --config=linreg_sweep --sweep_dir=results/linreg_sgd

x ~ N(0, C), y = x·w* + σε, a linear model, loss ½(x·w − y)². Near the optimum |G|² → 0 while
tr(Σ) → σ²·tr C, so B_simple grows like 1/(L − L*): the targets (0.01 down to 0.0004 above
the minimum 0.1254) put B_crit in the thousands. On a quadratic loss with SGD the theory
(McCandlish et al. 2018, App. A) holds to second order, so B_crit should sit near the
measured B_noise; the measured statistics equal a float64 reference and `linreg_noise_stats`
(tests/test_linreg_anchor.py). `:tiny` shrinks it for tests.
"""

from __future__ import annotations

from cbs.configs import base
from cbs.sweeps.grid import default_sweep_config, default_sweep_noise

__all__ = ["get_config"]


def get_config(arg: str = ""):
    words = base.parse_arg(arg, known=("tiny",))
    c = base.base_config("linreg", "mlp")
    c.data.options.dim = 64  # D features
    c.data.options.num_train = 32_768  # training examples
    c.data.options.num_eval = 2_048  # evaluation examples
    c.data.options.noise_std = 0.5  # σ, label noise (L* = σ²/2 = 0.125)
    c.data.options.cov_decay = 1.0  # eigenvalues of C: (1 + k)^-1, condition number 64
    c.model.hidden_sizes = ()  # linear model: 64 weights and a bias
    c.optim.name = "sgd"  # plain SGD: u = g, no momentum
    c.batch.micro_batch = 8192  # m: each trial's whole batch in one micro-batch
    c.eval.batch_size = 8192  # examples per evaluation chunk
    c.train.checkpoint_every = 2000  # steps between checkpoints (engine back end)

    s = c.sweep = default_sweep_config()
    s.batch_sizes = tuple(2 ** k for k in range(3, 14))  # 8 ... 8192 examples
    s.base_lr = 0.2  # η at B = 64, centre of the grid
    s.lr_rule = "linear"  # centre η(B) = base_lr·(B/64) (SGD)
    s.max_lr = 1.6  # cap below the stability limit 2/λ_max(H) = 1.99: a cap of 1.95 took
    #                 more steps to the deepest target at every B ≥ 1024 (70 vs 55 at
    #                 B = 8192), so 1.6 is at or above the large batches' optimum
    s.extend_lr_rounds = 4  # up to four factor-2 steps past an edge optimum
    s.seeds = (0, 1)  # two seeds per (B, η): the fit uses their mean steps
    s.targets = (0.135, 0.13, 0.1275, 0.1265, 0.126, 0.1258)  # training loss (min 0.12540)
    s.max_examples = 0  # steps bound the budget
    s.max_steps = 50_000  # updates per trial
    n = default_sweep_noise(c.noise)  # measured at each evaluation
    n.examples = "all"  # exact G, tr(Σ), GᵀHG on all training examples
    n.hessian_batch_size = 256  # ... and the Hessian of 256 independent ones
    if "tiny" in words:
        c.data.options.num_train = 1024  # a small training set
        s.batch_sizes = (8, 32, 128)  # three batch sizes
        s.lr_factors = (1.0, 2.0)  # two learning rates each
        s.seeds = (0,)  # one seed
        s.targets = (0.17, 0.16)  # loose targets
        base.make_tiny_sweep(s, steps=60, evals=6)
    return c
