"""Batch-size sweeps of the small CNNs on TFDS images (argument: mnist, fashion_mnist, cifar10).

    tfds build mnist --data_dir=~/tensorflow_datasets --file_format=array_record   # once
    cbs-sweep --config=cnn_sweep:mnist --sweep_dir=runs/mnist
    cbs-sweep --config=cnn_sweep:cifar10 \
        --sweep_dir=runs/cifar10 --shard=0/4 --noanalyze    # one of 4 array tasks

Not run here, so no result is recorded; expect B_crit of a few hundred images at the lowest
targets on MNIST (McCandlish et al. 2018: ~10²–10³ for MNIST-scale classifiers), larger on
CIFAR-10.
"""

from __future__ import annotations

from cbs.configs import base, cnn
from cbs.sweeps.grid import default_sweep_config, default_sweep_noise

__all__ = ["TARGETS", "get_config"]

TARGETS = {"mnist": (0.5, 0.2, 0.1, 0.05), "fashion_mnist": (0.8, 0.5, 0.4, 0.3),
           "cifar10": (1.8, 1.5, 1.2, 1.0)}  # eval cross-entropy (nats) per dataset


def get_config(arg: str = ""):
    c = cnn.get_config(arg)
    name = c.data.name
    c.batch.micro_batch = 4096  # each trial's batch in one micro-batch (vmapped groups)
    c.eval.num_examples = 2048  # fixed evaluation subset

    s = c.sweep = default_sweep_config()
    s.batch_sizes = tuple(2 ** k for k in range(4, 13))  # 16 ... 4096 images
    s.base_lr = 1e-3  # η at B = 128, centre of the grid
    s.base_batch_size = 128  # B at which base_lr is the centre
    s.lr_rule = "sqrt"  # η(B) = base_lr·(B/128)^½ (Adam)
    s.lr_factors = (0.5, 1.0, 2.0, 4.0)  # factor-2 grid
    s.max_lr = 0.02  # cap
    s.targets = TARGETS[name]  # eval loss targets (nats)
    s.target_metric = "eval/loss"  # fixed subset of 2,048 evaluation images
    s.max_examples = 3_000_000  # ≈ 50 epochs of MNIST per trial at most
    s.max_steps = 20_000  # and at most this many updates
    s.evals_per_trial = 80  # log-spaced evaluations
    n = default_sweep_noise(c.noise)  # measured at each evaluation, on a fresh stream
    n.every = 0  # not every k steps (the trials measure at their evaluations)
    n.deviations = 32  # tr(HΣ) from 32 of them
    if "tiny" in base.parse_arg(arg, ("tiny", *cnn.DATASETS)):
        s.batch_sizes = (16, 64)  # two batch sizes
        base.make_tiny_sweep(s, steps=10, evals=4)
        n.batch_size, n.curvature = 16, False  # small measurements, no B_noise
    return c
