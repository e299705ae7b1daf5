"""Character-level Transformer LM on the embedded Shakespeare plays (vocabulary 80, T = 64).

    cbs-train --config=shakespeare_transformer --workdir=/tmp/shakespeare
    cbs-train --config=shakespeare_transformer:tiny --workdir=/tmp/t

109k parameters: about 0.14 s per step on 2 CPU cores. Expected (2 shared CPU cores, one
device): 2000 steps in about 9 minutes; eval/loss falls from 4.40 to 1.76 nats per character
(accuracy 0.48), the training loss to about 1.70; noise/ema_b_simple (sequences of 64
characters) rises from about 2 to 24 at step 250, 86 at step 1000 and 390 at the end: the
noise scale grows as the loss falls (Kaplan et al. 2020).
"""

from __future__ import annotations

from cbs.configs import base

__all__ = ["get_config"]


def get_config(arg: str = ""):
    words = base.parse_arg(arg)
    c = base.base_config("shakespeare_char", "transformer")
    c.data.options.seq_len = 64  # T, characters per example (x and y = x shifted by one)
    c.model.size = "tiny"  # row of cbs.models.transformer.SIZES that the fields below override
    c.model.d_model = 64  # width D
    c.model.num_layers = 2  # blocks L
    c.model.num_heads = 4  # attention heads H (head size 16)
    c.model.d_ff = 256  # MLP hidden width F
    c.optim.name = "adamw"  # AdamW
    c.optim.learning_rate = 1e-3  # η_0 (peak)
    c.optim.weight_decay = 0.01  # decoupled, matrices only
    c.optim.warmup_examples = 6400  # linear warmup over 100 steps of B = 64
    c.optim.decay = "cosine"  # cosine decay to final_fraction·η_0 at train.max_examples
    c.optim.final_fraction = 0.1  # η at the end = 0.1·η_0
    c.optim.clip_norm = 1.0  # clip the mean gradient's global norm at 1
    c.batch.micro_batch = 16  # m per replica
    c.batch.schedule.batch_size = 64  # B, sequences per update (4096 characters)
    c.train.max_steps = 0  # no step limit: the budget is in examples
    c.train.max_examples = 128_000  # 2000 steps of B = 64 (≈ 1.8 passes over 70k windows)
    c.train.log_every = 50  # read metrics every 50 steps
    c.train.checkpoint_every = 1000  # steps between checkpoints
    c.eval.every = 250  # evaluation every 250 steps
    c.eval.num_examples = 2048  # first 2048 eval windows
    c.eval.full_train = False  # 70k training windows: the batch loss EMA is the train signal
    c.noise.every = 250  # exact per-example statistics every 250 steps
    if "tiny" in words:
        base.make_tiny(c)
        c.model.d_model = c.model.num_layers = c.model.num_heads = c.model.d_ff = 0  # = row
        c.train.max_steps, c.train.max_examples = 20, 0  # budget in steps
        c.optim.warmup_examples, c.optim.decay = 0, "constant"  # plain η_0
    return c
