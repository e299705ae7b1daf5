"""MNIST-1D (4000 train / 1000 eval, 40-sample 1-D signals, generated offline) with an MLP.

    cbs-train --config=mnist1d_mlp --workdir=/tmp/m1d
    cbs-train --config=mnist1d_mlp:tiny --workdir=/tmp/t

Expected (measured on 2 shared CPU cores, one device): 3000 steps in about 70 s;
full_train/loss falls from 2.43 to 0.003 (training accuracy 1.0: the MLP memorises the 4000
examples) while eval/loss is lowest (≈1.05, accuracy ≈0.61) near step 600 and then rises; the
best eval/accuracy is about 0.64. noise/ema_b_simple grows from about 230 to about 2000.
`:tiny` runs 20 steps in a few seconds.
"""

from __future__ import annotations

from cbs.configs import base

__all__ = ["get_config"]


def get_config(arg: str = ""):
    c = base.base_config("mnist1d", "mlp")
    c.model.hidden_sizes = (256, 256)  # two hidden layers of 256 units
    c.optim.name = "adam"  # Adam
    c.optim.learning_rate = 1e-3  # η_0
    c.optim.weight_decay = 0.0  # no regularisation (MNIST-1D overfits; eval/* shows it)
    c.batch.schedule.batch_size = 128  # B, examples per update
    c.train.max_steps = 3000  # ≈ 96 epochs of 4000 examples
    c.train.log_every = 50  # read metrics every 50 steps
    c.train.checkpoint_every = 1000  # steps between checkpoints
    c.eval.every = 100  # evaluation every 100 steps (1000 eval, 4000 train examples)
    c.noise.every = 100  # exact noise statistics every 100 steps
    c.noise.batch_size = 128  # on the step's whole batch
    if "tiny" in base.parse_arg(arg):
        base.make_tiny(c)
    return c
