"""A held-out task for the batch-size advice: an MLP student on a teacher network's labels.

    cbs-sweep --config=teacher_student_sweep:predict \
        --sweep_dir=results/heldout_teacher_student_predict
    cbs-advise --sweep_dir=results/heldout_teacher_student_predict
    cbs-sweep --config=teacher_student_sweep --sweep_dir=results/heldout_teacher_student

No committed study uses this data (`cbs.data.synthetic.teacher_student`: labels the argmax of
a random tanh teacher), so `cbs-advise` was never calibrated on it. `:predict` is ONE run at
B = 64 and the grid's centre rate, measured exactly on all training examples at every
evaluation; its predicted B_crit (80 % interval) is committed before the sweep tests it.
Measured B_crit at L = 0.4, 0.3, 0.2: 1.65k, 2.0k and 2.16k (bounded by B = 4,096 and 8,192).
"""

from __future__ import annotations

from cbs.configs import base
from cbs.sweeps.grid import default_sweep_config, default_sweep_noise

__all__ = ["get_config"]


def get_config(arg: str = ""):
    words = base.parse_arg(arg, known=("predict", "tiny"))
    c = base.base_config("teacher_student", "mlp")
    c.data.options.dim = 32  # input dimensions
    c.data.options.hidden = 64  # teacher's hidden units
    c.data.options.num_train = 8192  # training examples
    c.data.options.num_eval = 2048  # evaluation examples
    c.model.hidden_sizes = (128, 128)  # student: 32-128-128-10
    c.optim.name = "adam"  # Adam, constant rate
    c.batch.micro_batch = 2048  # m: each trial's whole batch in one micro-batch
    c.eval.batch_size = 8192  # the whole training set in one evaluation chunk
    c.train.checkpoint_every = 1000  # steps between checkpoints (engine back end)

    s = c.sweep = default_sweep_config()
    s.batch_sizes = tuple(2 ** k for k in range(3, 14))  # 8 ... 8192 (the full training set)
    s.base_lr = 2e-3  # η at B = 64, centre of the grid
    s.lr_rule = "sqrt"  # centre η(B) = base_lr·(B/64)^½ (Adam)
    s.max_lr = 0.05  # cap on any rate
    s.extend_lr_rounds = 3  # up to three factor-2 steps past an edge optimum
    s.targets = (1.0, 0.6, 0.4, 0.3, 0.2)  # full training-set cross-entropy (nats)
    s.max_examples = 2_000_000  # ≈ 240 epochs per trial at most
    s.max_steps = 8_000  # and at most this many updates
    s.evals_per_trial = 80  # log-spaced progress evaluations up to the budget
    n = default_sweep_noise(c.noise)  # measured at each evaluation
    n.examples = "all"  # exact G, tr(Σ) on all training examples
    n.deviations = 32  # tr(HΣ) from the deviations of 32 random examples
    n.hessian_batch_size = 256  # ... and the Hessian of 256 independent ones
    if "predict" in words:
        s.batch_sizes = (64,)  # one batch size
        s.lr_factors = (1.0,)  # one rate: the grid's centre
        s.extend_lr_rounds = 0  # no extension (one run)
    if "tiny" in words:
        c.data.options.num_train = 512  # a small training set
        s.batch_sizes = (8, 32, 128)  # three batch sizes
        s.targets = (2.0, 1.8)  # loose targets
        base.make_tiny_sweep(s, steps=40, evals=6)
    return c
