"""Cost of measuring gradient noise, against one plain gradient, for three small models.

    python -m benchmarks.noise_cost            # median of 5 repeats (~15 min on 2 CPU cores,
                                               # most of it the CNN's exact trace_h_sigma)
    python -m benchmarks.noise_cost --quick    # 2 repeats, for a first look
    python -m benchmarks.noise_cost --models mlp,cnn --repeats 7 --skip-slow
    python -m benchmarks.noise_cost --foreign  # plain-JAX, nnx, equinox, haiku models (~6 min)

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

Models brought by a user (`--foreign`, no cbs layers): a plain-JAX MLP 784-256-256-10 at
B = 256; the same CNN on 28×28×1 at B = 128 (conv 32, conv 64 stride 2, LayerNorm over the
channels, linear head) written in `nnx`, in equinox (a per-example NCHW model vmapped in the
loss) and in haiku (the last two with `pip install -e ".[foreign]"`; a row says so when one
is missing); and a 6-layer Transformer LM under `nnx.scan` with `nnx.remat` at B = 32,
T = 64 (d = 128, V = 256). Rows: plain gradient;
`dropin.value_grad_and_stats` (loss, ḡ and every NoiseStats field from the jaxpr ghost norms);
the vmap fallback with its automatic chunk size (`exact(method="vmap")`, no chunk given).
The coverage column is the fraction of parameters on the fast path (`ghost.coverage`).

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
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbs import models
from cbs.stats import curvature, dropin, ghost, noise, trees

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


# ----------------------------------------------------------------------------- foreign models


def _plain_mlp(rng):
    sizes = (784, 256, 256, 10)
    params = [{"w": rng.normal(size=(a, b)).astype(np.float32) / np.sqrt(a),
               "b": np.zeros(b, np.float32)} for a, b in zip(sizes[:-1], sizes[1:], strict=True)]
    params = jax.device_put(params)

    def loss_fn(params, batch):
        h = batch["x"]
        for i, layer in enumerate(params):
            h = h @ layer["w"] + layer["b"]
            h = jax.nn.relu(h) if i < len(params) - 1 else h
        return _xent(h, batch["y"])

    batch = {"x": rng.normal(size=(256, 784)).astype(np.float32),
             "y": rng.integers(0, 10, 256).astype(np.int32)}
    return loss_fn, params, batch, "plain-JAX MLP 784-256-256-10, B=256"


class _NNXCNN(nnx.Module):
    def __init__(self, rngs):
        self.c1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
        self.c2 = nnx.Conv(32, 64, (3, 3), strides=(2, 2), rngs=rngs)
        self.ln = nnx.LayerNorm(64, rngs=rngs)
        self.head = nnx.Linear(14 * 14 * 64, 10, rngs=rngs)

    def __call__(self, x):
        h = self.ln(jax.nn.relu(self.c2(jax.nn.relu(self.c1(x)))))
        return self.head(h.reshape(h.shape[0], -1))


class _Block(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
        self.heads = heads

    def __call__(self, h):
        b, t, d = h.shape
        q, k, v = jnp.split(self.qkv(self.ln1(h)).reshape(b, t, 3 * self.heads, -1), 3, 2)
        s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        a = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(s, -1), v).reshape(b, t, d)
        h = h + self.out(a)
        return h + self.fc2(jax.nn.gelu(self.fc1(self.ln2(h))))


class _ScannedLM(nnx.Module):
    def __init__(self, vocab, length, d, heads, layers, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (length, d)))

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return _Block(d, heads, rngs)

        self.blocks = blocks(rngs)
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, ids):
        h = self.embed(ids) + self.pos[: ids.shape[1]]

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def run(h, block):
            return block(h)

        return self.head(self.ln(run(h, self.blocks)))


def _xent(logits, labels):
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))


def _nnx(model, batch, description):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss_fn = lambda p, b: _xent(nnx.merge(graphdef, p, rest)(b["x"]), b["y"])
    return loss_fn, params, batch, description


def _equinox_cnn(batch):
    """The nnx CNN's layers in equinox: a per-example NCHW model, vmapped in the loss."""
    import equinox as eqx

    k = jax.random.split(jax.random.key(0), 3)
    layers = (eqx.nn.Conv2d(1, 32, 3, padding=1, key=k[0]),
              eqx.nn.Conv2d(32, 64, 3, stride=2, padding=1, key=k[1]),
              eqx.nn.LayerNorm(64), eqx.nn.Linear(14 * 14 * 64, 10, key=k[2]))
    params, static = eqx.partition(layers, eqx.is_inexact_array)

    def forward(p, x_CxHxW):
        c1, c2, ln, head = eqx.combine(p, static)
        h = jax.nn.relu(c2(jax.nn.relu(c1(x_CxHxW))))  # [64, 14, 14]
        h = jax.vmap(jax.vmap(ln, 1, 1), 2, 2)(h)  # over the channels of each position
        return head(h.reshape(-1))

    def loss_fn(p, b):
        logits = jax.vmap(forward, (None, 0))(p, jnp.transpose(b["x"], (0, 3, 1, 2)))
        return _xent(logits, b["y"])

    return loss_fn, params, batch, "equinox Conv2d/LayerNorm/Linear CNN, B=128"


def _haiku_cnn(batch):
    import haiku as hk

    def forward(x):
        h = jax.nn.relu(hk.Conv2D(32, 3)(x))
        h = hk.LayerNorm(-1, True, True)(jax.nn.relu(hk.Conv2D(64, 3, stride=2)(h)))
        return hk.Linear(10)(h.reshape(h.shape[0], -1))

    model = hk.without_apply_rng(hk.transform(forward))
    params = model.init(jax.random.key(0), batch["x"][:2])
    loss_fn = lambda p, b: _xent(model.apply(p, b["x"]), b["y"])
    return loss_fn, params, batch, "haiku Conv2D/LayerNorm/Linear CNN, B=128"


def build_foreign(name: str):
    """(loss_fn, params, batch, description) of a model written without cbs layers; the
    equinox and haiku ones need `pip install -e ".[foreign]"` (ImportError otherwise)."""
    rng = np.random.default_rng(0)
    if name == "plain_mlp":
        return _plain_mlp(rng)
    if name in ("nnx_cnn", "equinox_cnn", "haiku_cnn"):
        batch = {"x": rng.normal(size=(128, 28, 28, 1)).astype(np.float32),
                 "y": rng.integers(0, 10, 128).astype(np.int32)}
        if name == "equinox_cnn":
            return _equinox_cnn(batch)
        if name == "haiku_cnn":
            return _haiku_cnn(batch)
        return _nnx(_NNXCNN(nnx.Rngs(0)), batch, "nnx.Conv/LayerNorm/Linear CNN, B=128")
    tokens = rng.integers(0, 256, (32, 65)).astype(np.int32)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    model = _ScannedLM(256, 64, 128, 4, 6, nnx.Rngs(0))
    return _nnx(model, batch, "6-layer Transformer LM, nnx.scan + remat, B=32, T=64")


FOREIGN = ("plain_mlp", "nnx_cnn", "equinox_cnn", "haiku_cnn", "scanned_lm")


def foreign_rows(loss_fn: Callable) -> dict[str, Callable]:
    """Plain gradient, exact statistics from the jaxpr, and the auto-chunked vmap fallback."""
    return {
        "plain gradient": jax.value_and_grad(loss_fn),
        "value_grad_and_stats": dropin.value_grad_and_stats(loss_fn),
        "exact-vmap (auto chunk)": lambda p, b: noise.exact(loss_fn, p, b, method="vmap"),
    }


def run_foreign(repeats: int) -> None:
    print("| model | method | time ms | × plain gradient | memory MB | coverage |")
    print("|---|---|---:|---:|---:|---:|")
    for name in FOREIGN:
        try:
            loss_fn, params, batch, description = build_foreign(name)
        except ImportError as err:
            print(f"| {name} | not measured: {err.name} is not installed "
                  '(pip install -e ".[foreign]") | | | | |', flush=True)
            continue
        batch = jax.device_put(batch)
        cover = ghost.coverage(loss_fn, params, batch)
        for label, seconds, ratio, mb in measure(foreign_rows(loss_fn), params, batch, repeats):
            print(f"| {description} | {label} | {seconds * 1e3:.2f} | {ratio:.2f} | {mb} | "
                  f"{cover:.0%} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="2 repeats instead of 5")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per row")
    parser.add_argument("--skip-slow", action="store_true",
                        help="leave out the exact trace_h_sigma row (minutes per call on CPU)")
    parser.add_argument("--foreign", action="store_true",
                        help="only the models written without cbs layers (plain JAX, nnx)")
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
    if args.foreign:
        return run_foreign(repeats)
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
