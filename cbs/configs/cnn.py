"""Small CNNs on TFDS images: mnist, fashion_mnist, cifar10 (the argument picks one).

    cbs-train --config=cnn:mnist --workdir=/tmp/mnist
    cbs-train --config=cnn:fashion_mnist --workdir=...
    cbs-train --config=cnn:cifar10 --workdir=/tmp/c10
    cbs-train --config=cnn:mnist,tiny --workdir=/tmp/t

Prepare the dataset first (nothing downloads unless --config.data.options.download=True):
`tfds build mnist --file_format=array_record`. Not run here, so no result is recorded; such a
CNN usually passes 98 % test accuracy on MNIST within a few epochs, ~90 % on Fashion-MNIST and
~65-70 % on CIFAR-10.
"""

from __future__ import annotations

from cbs.configs import base

__all__ = ["DATASETS", "get_config"]

DATASETS = ("mnist", "fashion_mnist", "cifar10")


def get_config(arg: str = ""):
    words = base.parse_arg(arg, ("tiny", *DATASETS))
    names = sorted(w for w in words if w in DATASETS) or ["mnist"]
    if len(names) > 1:
        raise ValueError(f"config argument {arg!r} names {len(names)} datasets "
                         f"({', '.join(names)}): name one of {', '.join(DATASETS)}")
    c = base.base_config(names[0], "cnn")
    c.model.channels = (16, 32) if names[0] != "cifar10" else (32, 64)  # conv block widths
    c.model.dense_sizes = (128,)  # dense head before the 10-way output
    c.model.norm = "groupnorm"  # per-example statistics stay well defined (not batchnorm)
    c.optim.name = "adam"  # Adam
    c.optim.learning_rate = 1e-3  # η_0
    c.batch.schedule.batch_size = 128  # B
    c.train.max_steps = 5000  # ≈ 10.7 epochs of 60k MNIST examples (12.8 of CIFAR-10)
    c.train.log_every = 50  # read metrics every 50 steps
    c.train.checkpoint_every = 1000  # steps between checkpoints
    c.eval.every = 500  # evaluation every 500 steps
    c.eval.full_train = False  # 50-60k training images: use the eval split and the batch loss
    c.noise.every = 250  # exact per-example statistics (ghost norms) every 250 steps
    if "tiny" in words:
        base.make_tiny(c)
        c.model.channels, c.model.dense_sizes = (4, 8), (16,)  # a few hundred parameters
    return c
