"""Speed of the cbs train step against a minimal jax.jit + optax loop, and its noise costs.

    python -m benchmarks.train_step            # full: more steps and repeats
    python -m benchmarks.train_step --quick    # about a minute or two on 2 CPU cores

For an MLP 784-256-256-10 (B = 256), a small CNN on 28×28×1 (B = 128) and the tiny
Transformer LM (B = 32, T = 128), on one device of the default backend (CPU here; the same
script runs unchanged on a GPU), with Adam and one fixed device-resident batch:

- `optax`: the reference, a hand-written `jax.jit` step (value_and_grad, optax.adam,
  apply_updates, donated buffers) returning the loss;
- `cbs`: `cbs.engine.step.TrainStep` with the two-batch estimator off (`two_batch=False`);
- `cbs+2batch (halves)`: the in-step two-batch estimate and its EMA on, with A = 1 on one
  device, where the only small batches are the two halves of the batch (C = 2 chunks);
- `cbs A=2` / `cbs A=2+2batch (micro)`: two accumulation steps without / with the estimate
  (the micro-batches are the small batches: the estimator's own cost);
- `... +exact/k (cond|jit)`: also an exact `cbs.stats.noise.exact` (fast path) measurement on the
  whole batch every k steps, under `lax.cond` in the step or as its own jitted call.

Each cell is the median over repeats of the mean time per step over a run of steps
(dispatch of step t+1 does not wait for step t; the clock stops after blocking on the last).
Targets: cbs ≥ 0.95× the optax loop's steps/s; the two-batch estimator ≤ 3 % overhead
(last column: against `cbs`, or against `cbs A=2` for the A = 2 rows).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx

from cbs import models
from cbs.engine import mesh as mesh_lib
from cbs.engine import optim, step


def _model(name: str):
    """(loss_fn, params, batch) for one of the three benchmark models."""
    rng = np.random.default_rng(0)
    if name == "mlp":
        mc = models.default_model_config("mlp")
        mc.hidden_sizes = (256, 256)
        shape, b, task, kw = (784,), 256, "classification", {"num_classes": 10}
        batch = {"x": rng.normal(size=(b, 784)).astype(np.float32),
                 "y": rng.integers(0, 10, b).astype(np.int32)}
    elif name == "cnn":
        mc = models.default_model_config("cnn")
        shape, b, task, kw = (28, 28, 1), 128, "classification", {"num_classes": 10}
        batch = {"x": rng.normal(size=(b, 28, 28, 1)).astype(np.float32),
                 "y": rng.integers(0, 10, b).astype(np.int32)}
    else:
        mc = models.default_model_config("transformer")
        mc.size = "tiny"
        shape, b, task, kw = (128,), 32, "lm", {"vocab_size": 80}
        tokens = rng.integers(0, 80, (b, 129)).astype(np.int32)
        batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    model = models.build_model(mc, input_shape=shape, rngs=nnx.Rngs(0), verbose=False, **kw)
    graphdef, params, rest = models.split_model(model)
    return models.make_loss_fn(graphdef, rest, task), params, batch


def _optax_runner(loss_fn, params, batch, lr: float):
    tx = optax.adam(lr)

    @jax.jit
    def init(p):
        return p, tx.init(p)

    def train_step(carry, batch):
        p, s = carry
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), loss

    jitted = jax.jit(train_step, donate_argnums=0)
    carry = init(params)

    def run(n):
        nonlocal carry
        for _ in range(n):
            carry, loss = jitted(carry, batch)
        return loss

    return run


def _cbs_runner(loss_fn, params, batch, lr: float, *, accum: int = 1, two_batch: bool = True,
                measure=None):
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    direction = optim.make_direction(ml_collections.ConfigDict({"name": "adam"}))
    rep = mesh_lib.replicated(mesh)
    state = jax.jit(lambda p: step.init_train_state(p, direction, learning_rate=lr),
                    out_shardings=rep)(params)
    b = jax.tree.leaves(batch)[0].shape[0]
    ts = step.TrainStep(step.stateless(loss_fn), direction, lambda e: 1.0, mesh,
                        jax.tree.map(lambda x: x.sharding, state), mesh_lib.batch_sharding(mesh),
                        micro_batch=b // accum, two_batch=two_batch, measure=measure)
    separate = measure is not None and not measure.in_step
    t = 0

    def run(n):
        nonlocal state, t
        for _ in range(n):
            if separate and t % measure.every == 0:
                state, _ = ts.measure_now(state, batch, accum)
            state, metrics = ts(state, batch, accum)
            t += 1
        return metrics

    return run


def _time(run, steps: int) -> float:
    """Seconds per step of one run of `steps` steps, blocking on the last."""
    start = time.perf_counter()
    jax.block_until_ready(run(steps))
    return (time.perf_counter() - start) / steps


def bench(name: str, steps: int, repeats: int, every: int) -> list[tuple[str, float]]:
    loss_fn, params, batch = _model(name)
    batch = jax.device_put(batch)
    measure = step.Measurement("fast", every, micro_batches=2)  # the whole batch
    variants = {
        "optax": _optax_runner(loss_fn, params, batch, 1e-3),
        "cbs": _cbs_runner(loss_fn, params, batch, 1e-3, two_batch=False),
        "cbs+2batch (halves)": _cbs_runner(loss_fn, params, batch, 1e-3),
        "cbs A=2": _cbs_runner(loss_fn, params, batch, 1e-3, accum=2, two_batch=False),
        "cbs A=2+2batch (micro)": _cbs_runner(loss_fn, params, batch, 1e-3, accum=2),
        f"cbs A=2+2batch+exact/{every} (cond)": _cbs_runner(
            loss_fn, params, batch, 1e-3, accum=2, measure=measure._replace(in_step=True)),
        f"cbs A=2+2batch+exact/{every} (jit)": _cbs_runner(
            loss_fn, params, batch, 1e-3, accum=2, measure=measure),
    }
    for run in variants.values():  # compile and warm up
        jax.block_until_ready(run(steps))
    # Interleave the variants over the repeats so that load on a shared machine hits all.
    out = {k: [] for k in variants}
    for _ in range(repeats):
        for k, run in variants.items():
            out[k].append(_time(run, steps))
    return [(k, statistics.median(v)) for k, v in out.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--models", default="mlp,cnn,transformer")
    args = parser.parse_args()
    steps, repeats, every = (20, 5, 10) if args.quick else (100, 9, 10)
    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"{steps} steps × {repeats} repeats per cell, median\n")
    print("| model | variant | ms/step | steps/s | vs optax | vs its baseline |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        rows = bench(name, steps, repeats, every)
        times = dict(rows)
        for variant, sec in rows:
            base = times["cbs A=2"] if variant.startswith("cbs A=2") else times["cbs"]
            print(f"| {name} | {variant} | {sec * 1e3:.3f} | {1 / sec:.1f} | "
                  f"{times['optax'] / sec:.3f}× | {(sec / base - 1) * 100:+.1f} % |", flush=True)


if __name__ == "__main__":
    main()
