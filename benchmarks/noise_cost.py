"""Cost of measuring gradient noise, against one plain gradient, for three small models.

    python -m benchmarks.noise_cost            # median of 5 repeats (~15 min on 2 CPU cores,
                                               # most of it the CNN's exact trace_h_sigma)
    python -m benchmarks.noise_cost --quick    # 2 repeats, for a first look
    python -m benchmarks.noise_cost --models mlp,cnn --repeats 7 --skip-slow

Models (from `cbs.models`, the same as benchmarks/train_step.py): an MLP 784-256-256-10 at
B = 256, the default CNN on 28×28×1 at B = 128, and the tiny Transformer LM at B = 32,
T = 128 (V = 80). Rows, each one jitted function of (params, batch):

- plain gradient: `jax.value_and_grad(loss_fn)`, the unit of the ratio column;
- exact-vmap: `cbs.stats.noise.exact(method="vmap")`, per-example gradients by vmap(grad), chunked;
- exact-fast: `cbs.stats.noise.exact(method="fast")`, ghost norms (one forward + one backward);
- ghost norms: `cbs.stats.ghost.per_example_grads_info(method="fast")` alone (loss, ḡ, per-leaf
  per-example norms);
- probe(1): `cbs.stats.noise.probe(num_probes=1)` (one JVP over the per-example losses);
- two-batch: ḡ of two micro-batches of B/2 (accumulated as a train step would) and
  `cbs.stats.noise.two_batch`;
- curvature g_h_g: ḡ and ḡᵀHḡ (one HVP, `cbs.curvature.vhv`);
- curvature trace_h_sigma: `cbs.stats.noise.exact(curvature=True)`, one HVP per example, chunked.

Time: median over repeats after one warm-up call; a repeat is as many back-to-back calls as
last about 0.1 s (one for slow rows), ended by block_until_ready. The ratio is the median of
ratios to a repeat of the plain gradient made just before each repeat, so load from other
processes on a shared machine mostly cancels.
Memory: XLA's `compiled.memory_analysis()`, temporaries + arguments (not a measured peak);
"n/a" where the backend does not report it. Runs unchanged on CPU, GPU or TPU (one device).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from cbs import models
from cbs.stats import curvature, ghost, noise, trees

# name: (batch size, chunk of exact-vmap, chunk of trace_h_sigma). trace_h_sigma takes one
# HVP of the whole-batch loss per example, so its vmapped chunk multiplies the working set
# by the batch size; on CPU the smaller chunk is faster as well as smaller.
MODELS = {
    "mlp": (256, 64, 16),
    "cnn": (128, 32, 1),
    "transformer": (32, 8, 2),
}


def build(name: str):
    """(loss_fn, params, batch, description) of one benchmark model."""
    rng = np.random.default_rng(0)
    b = MODELS[name][0]
    if name == "mlp":
        mc = models.default_model_config("mlp")
        mc.hidden_sizes = (256, 256)
        shape, task, kw = (784,), "classification", {"num_classes": 10}
        batch = {"x": rng.normal(size=(b, 784)).astype(np.float32),
                 "y": rng.integers(0, 10, b).astype(np.int32)}
    elif name == "cnn":
        mc = models.default_model_config("cnn")
        shape, task, kw = (28, 28, 1), "classification", {"num_classes": 10}
        batch = {"x": rng.normal(size=(b, 28, 28, 1)).astype(np.float32),
                 "y": rng.integers(0, 10, b).astype(np.int32)}
    else:
        mc = models.default_model_config("transformer")
        mc.size = "tiny"
        shape, task, kw = (128,), "lm", {"vocab_size": 80}
        tokens = rng.integers(0, 80, (b, 129)).astype(np.int32)
        batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    model = models.build_model(mc, input_shape=shape, rngs=nnx.Rngs(0), verbose=False, **kw)
    graphdef, params, rest = models.split_model(model)
    description = f"{model.description}, B={b}, P={models.param_count(model):,}"
    return models.make_loss_fn(graphdef, rest, task), params, jax.device_put(batch), description


def rows(loss_fn: Callable, batch_size: int, chunk: int, hvp_chunk: int
         ) -> dict[str, Callable]:
    """The measured functions of (params, batch)."""
    key = jax.random.key(0)

    def two_batch(params, batch):
        half = batch_size // 2
        g1 = jax.grad(loss_fn)(params, jax.tree.map(lambda a: a[:half], batch))
        g2 = jax.grad(loss_fn)(params, jax.tree.map(lambda a: a[half:], batch))
        sq_small = (trees.tree_sq_norm(g1) + trees.tree_sq_norm(g2)) / 2
        grad = jax.tree.map(lambda a, b: (a + b) / 2, g1, g2)
        return grad, noise.two_batch(sq_small, trees.tree_sq_norm(grad), half, batch_size)

    def g_h_g(params, batch):
        grad = jax.grad(loss_fn)(params, batch)
        return grad, curvature.vhv(loss_fn, params, batch, grad)

    return {
        "plain gradient": jax.value_and_grad(loss_fn),
        f"exact-vmap (chunk {chunk})":
            lambda p, b: noise.exact(loss_fn, p, b, method="vmap", chunk_size=chunk),
        "exact-fast": lambda p, b: noise.exact(loss_fn, p, b, method="fast"),
        "ghost norms": lambda p, b: ghost.per_example_grads_info(loss_fn, p, b, method="fast"),
        "probe(1)": lambda p, b: noise.probe(loss_fn, p, b, key, num_probes=1),
        "two-batch (2 × B/2)": two_batch,
        "curvature g_h_g": g_h_g,
        f"curvature trace_h_sigma (chunk {hvp_chunk})":
            lambda p, b: noise.exact(loss_fn, p, b, curvature=True, method="vmap",
                                     chunk_size=hvp_chunk),
    }


def memory_mb(compiled) -> str:
    try:
        stats = compiled.memory_analysis()
        total = stats.temp_size_in_bytes + stats.argument_size_in_bytes
    except (AttributeError, NotImplementedError, TypeError):
        return "n/a"
    return f"{total / 2**20:.1f}"


def timed(compiled, params, batch, calls: int = 1) -> float:
    """Seconds per call of `calls` back-to-back calls, blocking on the last."""
    start = time.perf_counter()
    for _ in range(calls):
        out = compiled(params, batch)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def measure(fns: dict[str, Callable], params, batch, repeats: int, min_seconds: float = 0.1):
    """Yields (label, median seconds, median ratio to the plain gradient, memory MB).

    A repeat of a row is enough back-to-back calls to last about `min_seconds` (one call for
    slow rows), and each is paired with a repeat of the plain gradient just before it; the
    ratio is the median of the paired ratios, so that load from other processes on a shared
    machine mostly cancels out of the ratio column.
    """
    (plain_label, plain_fn), *others = fns.items()
    plain = jax.jit(plain_fn).trace(params, batch).lower().compile()
    plain_calls = max(1, math.ceil(min_seconds / timed(plain, params, batch)))
    plain_time = lambda: timed(plain, params, batch, plain_calls)
    yield plain_label, statistics.median(plain_time() for _ in range(repeats)), 1.0, \
        memory_mb(plain)
    for label, fn in others:
        compiled = jax.jit(fn).trace(params, batch).lower().compile()
        calls = max(1, math.ceil(min_seconds / timed(compiled, params, batch)))
        times, ratios = [], []
        for _ in range(repeats):
            base = plain_time()
            times.append(timed(compiled, params, batch, calls))
            ratios.append(times[-1] / base)
        yield label, statistics.median(times), statistics.median(ratios), memory_mb(compiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="2 repeats instead of 5")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per row")
    parser.add_argument("--skip-slow", action="store_true",
                        help="leave out the exact trace_h_sigma row (minutes per call on CPU)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated subset of {','.join(MODELS)}")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    names = [n for n in args.models.split(",") if n]
    unknown = set(names) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; known: {list(MODELS)}")
    device = jax.devices()[0]
    print(f"jax {jax.__version__}, {device.platform} ({device.device_kind}), "
          f"median of {repeats} after warm-up; memory = XLA temp + argument bytes\n")
    for name in names:
        loss_fn, params, batch, description = build(name)
        batch_size, chunk, hvp_chunk = MODELS[name]
        print(f"### {name}: {description}\n")
        print("| method | time ms | × plain gradient | memory MB |")
        print("|---|---:|---:|---:|")
        fns = rows(loss_fn, batch_size, chunk, hvp_chunk)
        if args.skip_slow:
            fns = {k: v for k, v in fns.items() if "trace_h_sigma" not in k}
        for label, seconds, ratio, mb in measure(fns, params, batch, repeats):
            print(f"| {label} | {seconds * 1e3:.2f} | {ratio:.2f} | {mb} |", flush=True)
        print()


if __name__ == "__main__":
    main()
