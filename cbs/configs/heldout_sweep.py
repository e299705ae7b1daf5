"""Three held-out tasks for the batch-size advice (the argument picks one), each unlike the
tasks `cbs-advise` was calibrated on (data set and model family): `digits_cnn`, a CNN on the
8×8 digit images with Adam; `mnist1d_cnn`, a 1-D CNN on MNIST-1D with Adam; `regression`, a
16-64-64-1 tanh MLP regressing a random tanh teacher with label noise
(`cbs.data.synthetic.teacher_regression`, squared error) with plain SGD.

    cbs-sweep --config=heldout_sweep:digits_cnn,predict \
        --sweep_dir=results/heldout_digits_cnn_predict
    cbs-advise --sweep_dir=results/heldout_digits_cnn_predict
    cbs-sweep --config=heldout_sweep:digits_cnn --sweep_dir=results/heldout_digits_cnn

`predict` is ONE run at the grid's centre batch size and rate, measured exactly on all
training examples at every evaluation; `cbs-advise --sweep_dir` turns it into a predicted
B_crit per target, committed before the sweep tests it. The batch sizes reach the full
training set, so no B_crit lies past the largest. `tiny` shrinks any of them for tests;
without a task the argument means `digits_cnn`.
"""

from __future__ import annotations

from cbs.configs import base
from cbs.sweeps.grid import default_sweep_config, default_sweep_noise

__all__ = ["TASKS", "get_config"]

TASKS = ("digits_cnn", "mnist1d_cnn", "regression")


def _digits_cnn(c, s) -> None:
    c.data.options.flatten = False  # [8, 8, 1] images
    c.model.channels = (8, 16)  # conv block widths
    c.model.dense_sizes = (32,)  # dense head
    c.model.norm = "groupnorm"  # per-example statistics stay well defined
    c.optim.name = "adam"  # Adam, constant rate
    s.batch_sizes = (*(2 ** k for k in range(3, 11)), 1438)  # 8 ... 1024, full batch
    s.base_lr = 4e-3  # η at B = 64, centre of the grid
    s.lr_rule = "sqrt"  # centre η(B) = base_lr·(B/64)^½ (Adam)
    s.max_lr = 0.1  # cap on any rate
    s.targets = (0.5, 0.3, 0.2, 0.1, 0.05)  # full training-set cross-entropy (nats)
    s.max_examples = 600_000  # ≈ 420 epochs per trial at most
    s.max_steps = 6_000  # and at most this many updates


def _mnist1d_cnn(c, s) -> None:
    c.model.channels = (16, 32)  # conv block widths
    c.model.kernel_size = 5  # 5 × 1 kernels on the 40-sample signal
    c.model.dense_sizes = (64,)  # dense head
    c.model.norm = "groupnorm"  # per-example statistics stay well defined
    c.optim.name = "adam"  # Adam, constant rate
    s.batch_sizes = (*(2 ** k for k in range(3, 12)), 4000)  # 8 ... 2048, full batch
    s.base_lr = 3e-3  # η at B = 64, centre of the grid
    s.lr_rule = "sqrt"  # centre η(B) = base_lr·(B/64)^½ (Adam)
    s.max_lr = 0.05  # cap on any rate
    s.targets = (1.5, 1.0, 0.6, 0.3, 0.15)  # full training-set cross-entropy (nats)
    s.max_examples = 1_200_000  # 300 epochs per trial at most
    s.max_steps = 8_000  # and at most this many updates


def _regression(c, s) -> None:
    c.data.options.dim = 16  # input dimensions
    c.data.options.hidden = 32  # teacher's hidden units
    c.data.options.num_train = 8192  # training examples
    c.data.options.num_eval = 2048  # evaluation examples
    c.data.options.noise_std = 0.1  # label noise: loss floor σ²/2 = 0.005
    c.model.hidden_sizes = (64, 64)  # student: 16-64-64-1
    c.model.activation = "tanh"  # smooth student
    c.optim.name = "sgd"  # plain SGD: u = g, no momentum
    s.batch_sizes = tuple(2 ** k for k in range(3, 14))  # 8 ... 8192 (the full batch)
    s.base_lr = 0.05  # η at B = 64, centre of the grid
    s.lr_rule = "linear"  # centre η(B) = base_lr·(B/64) (SGD)
    s.max_lr = 1.0  # cap on any rate
    s.targets = (0.2, 0.1, 0.05, 0.03, 0.02)  # full training-set ½ squared error
    s.max_examples = 2_000_000  # ≈ 240 epochs per trial at most
    s.max_steps = 8_000  # and at most this many updates


def get_config(arg: str = ""):
    words = base.parse_arg(arg, known=(*TASKS, "predict", "tiny"))
    tasks = [w for w in words if w in TASKS]
    if len(tasks) > 1:
        raise ValueError(f"heldout_sweep takes one task of {TASKS} in its argument "
                         f"(e.g. --config=heldout_sweep:digits_cnn); got {arg!r}")
    task = tasks[0] if tasks else TASKS[0]
    data_name, model, settings = {"digits_cnn": ("digits", "cnn", _digits_cnn),
                                  "mnist1d_cnn": ("mnist1d", "cnn", _mnist1d_cnn),
                                  "regression": ("teacher_regression", "mlp", _regression)}[task]
    c = base.base_config(data_name, model)
    c.train.checkpoint_every = 1000  # steps between checkpoints (engine back end)
    s = c.sweep = default_sweep_config()
    settings(c, s)
    c.batch.micro_batch = s.batch_sizes[-1]  # m: the full batch, each trial's in one micro-batch
    c.eval.batch_size = s.batch_sizes[-1]  # the whole training set in one evaluation chunk
    s.extend_lr_rounds = 3  # up to three factor-2 steps past an edge optimum
    s.evals_per_trial = 60  # log-spaced progress evaluations up to the budget
    n = default_sweep_noise(c.noise)  # measured at each evaluation
    n.examples = "all"  # exact G, tr(Σ) on all training examples
    n.deviations = 32  # tr(HΣ) from the deviations of 32 random examples
    n.hessian_batch_size = 128  # ... and the Hessian of 128 independent ones (unbiased)
    if "predict" in words:
        s.batch_sizes = (64,)  # one batch size: the grid's centre
        s.lr_factors = (1.0,)  # one rate: the grid's centre
        s.extend_lr_rounds = 0  # no extension (one run)
    if "tiny" in words:
        s.batch_sizes = (8, 32)  # two batch sizes
        s.lr_factors = (1.0,)  # one rate each
        s.targets = s.targets[:1]  # the loosest target
        base.make_tiny_sweep(s, steps=30, evals=4)
    return c
