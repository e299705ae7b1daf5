"""The scanned LM (`cbs.models.lm`) on the embedded Shakespeare characters: the pod-shaped
path (scanned blocks, remat, bf16 compute, named FSDP × TP shardings, throughput records) at a
size a CPU runs.

    cbs-train --config=lm_shakespeare:tiny --workdir=/tmp/lm_tiny
    cbs-train --config=lm_shakespeare \
        --workdir=/tmp/lm --config.mesh.model=2 --config.mesh.param_mode=fsdp_tp

Arguments (comma-separated): "tiny" (the test size), "124m" / "1b" (those rows of
cbs.models.lm.LM_SIZES, for an accelerator slice; docs/scaling.md). Train records carry perf/*
(tokens/s, examples/s, step time, MFU where the peak is known) and data/tokens_seen.
Expected (":tiny", 2 shared CPU cores): 20 steps in well under a minute; the training loss
falls from ln 80 ≈ 4.38 nats per character.
"""

from __future__ import annotations

from cbs.configs import base

__all__ = ["get_config"]


def get_config(arg: str = ""):
    words = base.parse_arg(arg, known=("tiny", "124m", "1b"))
    c = base.base_config("shakespeare_char", "lm")
    c.data.options.seq_len = 64  # T, characters per example
    c.model.size = "small"  # row of cbs.models.lm.LM_SIZES (D = 256, L = 4)
    c.model.remat = "dots"  # keep matmul outputs, recompute the rest of each block
    c.model.compute_dtype = "bfloat16"  # matmuls in bf16; params and optimizer state float32
    c.optim.name = "adamw"  # AdamW
    c.optim.learning_rate = 1e-3  # η_0 (peak)
    c.optim.weight_decay = 0.1  # decoupled, matrices only
    c.optim.warmup_examples = 6400  # linear warmup over 100 steps of B = 64
    c.optim.decay = "cosine"  # cosine to final_fraction·η_0 at train.max_examples
    c.optim.final_fraction = 0.1  # η at the end = 0.1·η_0
    c.optim.clip_norm = 1.0  # clip the mean gradient's global norm at 1
    c.batch.micro_batch = 16  # m per replica
    c.batch.schedule.batch_size = 64  # B, sequences per update
    c.train.max_steps = 0  # the budget is in examples
    c.train.max_examples = 128_000  # 2000 steps of B = 64
    c.train.log_every = 50  # read metrics every 50 steps
    c.train.checkpoint_every = 1000  # steps between checkpoints
    c.eval.every = 250  # evaluation every 250 steps
    c.eval.num_examples = 2048  # first 2048 eval windows
    c.eval.full_train = False  # the batch loss EMA is the train signal
    c.noise.every = 250  # exact per-example statistics every 250 steps
    c.mesh.param_mode = "fsdp_tp"  # by name: FSDP over data, tensor parallel over model
    c.perf.records = True  # perf/* in the train records
    if "tiny" in words:
        base.make_tiny(c)
        c.model.size, c.model.remat = "tiny", "full"
        c.model.compute_dtype = "float32"  # CPU: bf16 matmuls are emulated and slow
        c.train.max_steps, c.train.max_examples = 20, 0  # budget in steps
        c.optim.warmup_examples, c.optim.decay = 0, "constant"  # plain η_0
    for size in ("124m", "1b"):
        if size in words:
            c.model.size = size
            c.data.options.seq_len = 1024  # T
            c.batch.micro_batch = 8  # m per replica
            c.batch.schedule.batch_size = 512  # B = 512 × 1024 = 0.5M tokens
            c.perf.compilation_cache_dir = "/tmp/cbs_xla_cache"  # reuse compiled steps
    if "124m" in words:
        c.model.scan_unroll = 12  # all 12 layers unrolled: 35.8 % MFU against 30.2 % rolled
        #                           on one H200 (docs/guides/benchmarks.md)
    return c
