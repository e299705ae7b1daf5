"""Character-level Transformer LM on the embedded Shakespeare plays (vocabulary 80, T = 64).

    python -m experiments.main --config=experiments/configs/shakespeare_transformer.py \
        --workdir=/tmp/shakespeare
    python -m experiments.main --config=experiments/configs/shakespeare_transformer.py:tiny \
        --workdir=/tmp/t

The model is the "small" row of cbs.models.SIZES (D = 128, 4 layers, 4 heads, rotary
positions); "tiny" uses the "tiny" row (D = 32, 2 layers) and 20 steps.
Expected: see RESULT below.
"""

from __future__ import annotations

from experiments.configs import base

RESULT = "not measured yet"


def get_config(arg: str = ""):
    words = base.parse_arg(arg)
    c = base.base_config("shakespeare_char", "transformer")
    c.data.options.seq_len = 64  # T, characters per example (x and y = x shifted by one)
    c.model.size = "tiny" if "tiny" in words else "small"  # row of cbs.models.SIZES
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
    c.train.max_examples = 192_000  # 3000 steps of B = 64 (≈ 2.7 passes over 70k windows)
    c.train.log_every = 50  # read metrics every 50 steps
    c.train.checkpoint_every = 1000  # steps between checkpoints
    c.eval.every = 250  # evaluation every 250 steps
    c.eval.num_examples = 2048  # first 2048 eval windows
    c.eval.full_train = False  # 70k training windows: the batch loss EMA is the train signal
    c.noise.every = 250  # exact per-example statistics every 250 steps
    if "tiny" in words:
        base.make_tiny(c)
        c.train.max_steps, c.train.max_examples = 20, 0  # budget in steps
        c.optim.warmup_examples, c.optim.decay = 0, "constant"  # plain η_0
    return c
