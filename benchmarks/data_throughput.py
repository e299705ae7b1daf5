"""Data throughput: examples/s that cbs.data delivers beside what a jitted train step consumes.

    python benchmarks/data_throughput.py           # full
    python benchmarks/data_throughput.py --quick   # fewer repeats and batch sizes
    python benchmarks/data_throughput.py --datasets=digits,mnist1d

By default every dataset whose extra is installed is measured (mnist1d needs `[mnist1d]`;
without it that row is skipped with a note on stderr); a dataset named in --datasets whose
extra is missing stops with a one-line error (exit status 2).

For digits and mnist1d (MLP 256-256, Adam) and shakespeare_char (T=128; embedding, a
4-character causal context and an MLP, Adam) at several batch sizes B it times:
  device: the on-device gather `cbs.data.batching.device_batch` inside jit, 16 consecutive
          batches per call (stacked into one output), so per-call dispatch is amortised as in
          a step;
  host:   `cbs.data.HostLoader` (numpy gather on the host, 2 prefetch threads);
  step:   the jitted train step on a batch already on device;
  step+gather: the train step that gathers its own batch from (arrays, examples_seen).
Each entry is the median over repeats of a timed loop after warm-up. The ratio columns are
delivered / consumed; the data pipeline is not the bottleneck when they are well above 1
(target: >= 5 on the MLP). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cbs.data as data
from cbs.data import batching
from cbs.runtime import cli

_PER_CALL = 16  # batches gathered per jit call in the device measurement


def _init_dense(key, sizes):
    params = []
    keys = jax.random.split(key, len(sizes) - 1)
    for k, d_in, d_out in zip(keys, sizes[:-1], sizes[1:], strict=True):
        params.append({"w": jax.random.normal(k, (d_in, d_out)) / np.sqrt(d_in),
                       "b": jnp.zeros(d_out)})
    return params


def _mlp(layers, h):
    for layer in layers[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    return h @ layers[-1]["w"] + layers[-1]["b"]


def mlp_model(ds, key, width=256):
    params = {"mlp": _init_dense(key, [ds.input_shape[0], width, width, ds.num_classes])}

    def loss_fn(params, batch):
        logits = _mlp(params["mlp"], batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return params, loss_fn


def char_model(ds, key, width=128, emb=32, context=4):
    k1, k2 = jax.random.split(key)
    params = {"embed": jax.random.normal(k1, (ds.vocab_size, emb)) * 0.1,
              "mlp": _init_dense(k2, [emb * context, width, ds.vocab_size])}

    def loss_fn(params, batch):
        e_BxTxE = params["embed"][batch["x"]]
        shifted = [jnp.pad(e_BxTxE, ((0, 0), (c, 0), (0, 0)))[:, : e_BxTxE.shape[1]]
                   for c in range(context)]
        logits = _mlp(params["mlp"], jnp.concatenate(shifted, -1))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return params, loss_fn


def _timed(fn, calls: int, repeats: int) -> float:
    """Median seconds per call of fn(i) over `repeats` loops of `calls` calls."""
    jax.block_until_ready(fn(0))
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        out = None
        for i in range(calls):
            out = fn(1 + r * calls + i)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def measure(name, ds, model, batch_size, calls, repeats, seed=0):
    arrays = ds.device_arrays()
    optimizer = optax.adam(1e-3)
    params, loss_fn = model(ds, jax.random.key(seed))
    opt_state = optimizer.init(params)

    def update(params, opt_state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(update, donate_argnums=(0, 1))
    gather = jax.jit(functools.partial(batching.device_batch, ds, seed=seed), static_argnums=2)

    @jax.jit
    def gather_many(arrays, examples_seen):
        def body(carry, k):
            return carry, batching.device_batch(ds, arrays, examples_seen + k * batch_size,
                                            batch_size, seed=seed)
        return jax.lax.scan(body, 0, jnp.arange(_PER_CALL))[1]

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step_gather(params, opt_state, arrays, examples_seen):
        batch = batching.device_batch(ds, arrays, examples_seen, batch_size, seed=seed)
        return update(params, opt_state, batch)

    n = ds.num_train
    t_device = _timed(
        lambda i: gather_many(arrays, jnp.int32(i * _PER_CALL * batch_size % n)), calls,
        repeats) / _PER_CALL
    with data.HostLoader(ds, seed=seed, prefetch=2, num_workers=2) as loader:
        t_host = _timed(lambda i: loader(i * batch_size, batch_size), calls, repeats)
    batch = gather(arrays, jnp.int32(0), batch_size)
    state = [params, opt_state]

    def run_step(i):
        state[:] = step(state[0], state[1], batch)
        return state[0]

    def run_step_gather(i):
        state[:] = step_gather(state[0], state[1], arrays, jnp.int32(i * batch_size % n))
        return state[0]

    t_step = _timed(run_step, calls, repeats)
    t_step_gather = _timed(run_step_gather, calls, repeats)
    rate = lambda t: batch_size / t  # noqa: E731
    return {"dataset": name, "B": batch_size, "device": rate(t_device), "host": rate(t_host),
            "step": rate(t_step), "step+gather": rate(t_step_gather)}


_DATASETS = {  # name -> (get_dataset kwargs, model, quick sizes, full sizes)
    "digits": ({}, mlp_model, (32, 256, 1024), (32, 128, 512, 1024)),
    "mnist1d": ({}, mlp_model, (32, 256, 1024), (32, 128, 512, 2048)),
    "shakespeare_char": ({"seq_len": 128}, char_model, (16, 64, 256), (16, 64, 256, 512)),
}


def _plan(names, quick):
    """(name, dataset, model, sizes) per dataset; one whose extra is missing is skipped with a
    note when it was not asked for by name."""
    plan = []
    for name in names or _DATASETS:
        kwargs, model, quick_sizes, sizes = _DATASETS[name]
        try:
            ds = data.get_dataset(name, **kwargs)
        except ImportError as err:
            if names or not cli.is_missing_extra(err):
                raise
            print(f"{name} skipped: {err}", file=sys.stderr)
            continue
        plan.append((name, ds, model, quick_sizes if quick else sizes))
    return plan


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and batch sizes")
    parser.add_argument("--datasets", default="", help="comma-separated subset of "
                        f"{','.join(_DATASETS)} (default: all whose extra is installed)")
    args = parser.parse_args(argv)
    calls, repeats = (8, 3) if args.quick else (30, 5)
    names = [n for n in args.datasets.split(",") if n]
    if set(names) - set(_DATASETS):
        parser.error(f"--datasets: unknown {sorted(set(names) - set(_DATASETS))}; choose "
                     f"from {','.join(_DATASETS)}")
    plan = _plan(names, args.quick)
    print(f"backend: {jax.default_backend()}, devices: {jax.device_count()}, "
          f"quick: {args.quick}\n")
    print("| dataset | model | B | device gather ex/s | host loader ex/s | train step ex/s "
          "| step+gather ex/s | device/step | host/step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, ds, model, sizes in plan:
        for b in sizes:
            r = measure(name, ds, model, b, calls, repeats)
            kind = "MLP 256-256" if model is mlp_model else "char MLP, T=128"
            print(f"| {name} | {kind} | {b} | {r['device']:,.0f} | {r['host']:,.0f} | "
                  f"{r['step']:,.0f} | {r['step+gather']:,.0f} | "
                  f"{r['device'] / r['step']:.1f}x | {r['host'] / r['step']:.1f}x |",
                  flush=True)


if __name__ == "__main__":
    cli.guarded(lambda argv: main(argv[1:]))(sys.argv)  # user errors: one line, status 2
