"""Kaplan-style study: critical batch size of a character-level Transformer LM against loss.

    cbs-sweep --config=shakespeare_sweep --sweep_dir=runs/shakespeare

A 2-layer, D = 64 Transformer (~109k parameters) on the embedded Shakespeare plays, AdamW at a
constant rate, targets on the loss over 512 evaluation windows. B_simple is measured at every
evaluation on 128 fresh training windows (B_noise is off: exact curvature of a Transformer
costs O(n²) HVPs). Expected (2 CPU cores, ~10 minutes): B_crit rises as the target loss
falls, roughly as a power of the loss (Kaplan et al. 2020, eq. 5.3), and B_simple with it.
"""

from __future__ import annotations

from cbs.configs import base
from cbs.sweeps.grid import default_sweep_config, default_sweep_noise

__all__ = ["get_config"]


def get_config(arg: str = ""):
    c = base.base_config("shakespeare_char", "transformer")
    c.data.options.seq_len = 32  # T, characters per example
    c.model.size = "tiny"  # row of cbs.models.transformer.SIZES overridden below
    c.model.d_model = 64  # width D
    c.model.num_layers = 2  # blocks
    c.model.num_heads = 4  # heads (size 16)
    c.model.d_ff = 256  # MLP width
    c.optim.name = "adamw"  # AdamW at a constant rate (no warmup, no decay)
    c.optim.weight_decay = 0.01  # decoupled, matrices only
    c.optim.clip_norm = 1.0  # clip the mean gradient's global norm at 1
    c.batch.micro_batch = 256  # every trial's batch in one micro-batch
    c.eval.num_examples = 512  # fixed evaluation subset (windows)
    c.eval.batch_size = 512  # one evaluation chunk
    c.eval.full_train = False  # 140k training windows: progress is measured on eval windows

    s = c.sweep = default_sweep_config()
    s.batch_sizes = (8, 16, 32, 64, 128, 256)  # sequences of 32 characters
    s.base_lr = 3e-3  # η at B = 64, centre of the grid
    s.lr_rule = "sqrt"  # η(B) = base_lr·(B/64)^½ (Adam)
    s.lr_factors = (1.0, 2.0, 4.0)  # three learning rates per batch size
    s.max_lr = 0.02  # cap
    s.targets = (3.0, 2.6, 2.4, 2.2)  # eval loss, nats per character (ln 80 = 4.38 at init)
    s.target_metric = "eval/loss"  # fixed subset of 512 evaluation windows
    s.max_examples = 60_000  # per trial, in sequences
    s.max_steps = 3_000  # per trial
    s.evals_per_trial = 60  # log-spaced
    n = default_sweep_noise(c.noise)  # measured at each evaluation, on a fresh stream
    n.batch_size = 128  # windows per B_simple measurement
    n.curvature = False  # no B_noise (see the docstring)
    n.deviations = 0  # (no curvature: no deviations; as the committed study was defined)
    n.chunk_size = 32  # vmap chunk of the measurement
    if "tiny" in base.parse_arg(arg):
        c.model.d_model = c.model.num_layers = c.model.num_heads = c.model.d_ff = 0  # tiny row
        s.batch_sizes = (8, 32)  # two batch sizes
        s.targets = (4.0, 3.5)  # loose targets
        base.make_tiny_sweep(s, steps=20, evals=5)
        n.batch_size = 16  # small measurements
    return c
