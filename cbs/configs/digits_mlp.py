"""digits (scikit-learn, 1438 train / 359 eval, 8×8 images) with a 64-128-128-10 MLP and Adam.

    cbs-train --config=digits_mlp --workdir=/tmp/digits
    cbs-train --config=digits_mlp:tiny --workdir=/tmp/t

Expected (measured on 2 shared CPU cores, one device): 2000 steps of B = 128 in about 20 s;
full_train/loss falls from 2.30 to about 6e-4 (training accuracy 1.0), eval/loss to about
0.06 and eval/accuracy to about 0.98; noise/ema_b_simple grows from about 90 at the start
to a few thousand as the gradient vanishes (single exact measurements on 128 examples are
noisy and can be negative once |G|² is small). `:tiny` runs 20 steps in a few seconds.
"""

from __future__ import annotations

from cbs.configs import base

__all__ = ["get_config"]


def get_config(arg: str = ""):
    c = base.base_config("digits", "mlp")
    c.model.hidden_sizes = (128, 128)  # two hidden layers of 128 units
    c.optim.name = "adam"  # Adam (coupled L2 off)
    c.optim.learning_rate = 1e-3  # η_0, at B_0 = 128
    c.batch.micro_batch = 32  # m per replica: B = 128 works for 1, 2 or 4 data replicas
    c.batch.schedule.batch_size = 128  # B, examples per update
    c.train.max_steps = 2000  # ≈ 178 epochs of the 1438 training examples
    c.train.log_every = 50  # read metrics from the device every 50 steps
    c.eval.every = 100  # evaluation (eval split and whole training set) every 100 steps
    c.noise.every = 100  # exact per-example noise statistics every 100 steps
    c.noise.batch_size = 128  # measured on the step's whole batch (4 micro-batches of 32)
    if "tiny" in base.parse_arg(arg):
        base.make_tiny(c)
    return c
