"""Speed of the cbs train step against a minimal jax.jit + optax loop, and its noise costs.

    python -m benchmarks.train_step            # full: more steps and repeats
    python -m benchmarks.train_step --quick    # a few minutes on 2 CPU cores

For an MLP 784-256-256-10 (B = 256), a small CNN on 28×28×1 (B = 128), the tiny Transformer
(B = 32, T = 128) and the tiny scanned LM of `cbs.models.lm` (B = 32, T = 128, its default
bfloat16 compute), on one device of the default backend (CPU here; the same script runs
unchanged on a GPU), with Adam and one fixed device-resident batch:

- `optax`: the reference, a hand-written `jax.jit` step (value_and_grad, optax.adam,
  apply_updates, donated buffers) returning the loss;
- `optax + grad norm`: the same step also returning `optax.tree.norm` of the gradient, the
  one per-step statistic of the cbs step that reads the whole gradient again (it is logged
  and guards against non-finite gradients);
- `cbs (no estimate)`: `cbs.engine.step.TrainStep` with the live estimate off (`live="none"`);
  it still records the gradient norm (`opt/grad_norm`), so it is compared with both loops;
- `cbs (no estimate, no grad norm)`: the same with `grad_norm=False` (`train.grad_norm`), the
  step that computes what the bare optax loop computes;
- `cbs + live`: the default live estimate (`live="auto"`: exact tr(Σ) and |G|² from the
  per-example gradient norms of the step's own backward pass where `cbs.stats.ghost` reads the
  model, else two-batch; the `live` column says which ran) and its EMA;
- `cbs + two-batch (halves)`: the two-batch estimate instead, with A = 1 on one device, where
  the only small batches are the two halves of the batch (C = 2 chunks);
- `... + exact/k`: also an exact B_simple measurement of the whole batch every k steps: with an
  exact live estimate it is that estimate (no extra pass); with the two-batch estimate it is
  `cbs.stats.noise.exact` (fast path) in its own jitted call (`Measurement`), amortised;
- `cbs A=2 ...`: two accumulation steps (the live estimate sums the per-example norms over
  the micro-batches).

Each time is the mean per step over a run of n steps (dispatch of step t+1 does not wait for
step t; the clock stops after blocking on the last), n the larger of 10 (50 in the full run)
and enough steps for the optax loop to take 0.3 s (1 s), rounded up to a multiple of 10 (the
measurement period). After a warm-up, each repeat times every pair of a variant and the
baseline named in the `vs` column as four adjacent runs, baseline, variant, variant, baseline,
so that a load drifting over them cancels; the pair's ratio in that repeat is (v₁ + v₂) /
(b₁ + b₂) (against the optax loops inverted, a speed ratio; otherwise a cost ratio), reported
as median [min, max] over the repeats, and judged against its target (`verdict`: met or not
met in every repeat, or which side the median is on when the repeats straddle the bound,
i.e. where this machine's noise exceeds the difference). Targets: cbs without estimates
≥ 0.97× the speed of the optax loop that computes the same (with and without the gradient
norm); the live estimate ≤ 1.05× the step without it; the periodic exact measurement
≤ 1.03× amortised.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx

from cbs import models
from cbs.engine import optim, step
from cbs.engine.measure import Measurement
from cbs.engine.noise_spec import NoiseSpec
from cbs.engine.state import init_train_state, stateless
from cbs.runtime import mesh as mesh_lib


def _model(name: str):
    """(loss_fn, params, batch) for one of the benchmark models."""
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
    elif name == "lm":
        mc = models.default_model_config("lm")
        mc.size = "tiny"
        shape, b, task, kw = (128,), 32, "lm", {"vocab_size": 80}
        tokens = rng.integers(0, 80, (b, 129)).astype(np.int32)
        batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    else:
        mc = models.default_model_config("transformer")
        mc.size = "tiny"
        shape, b, task, kw = (128,), 32, "lm", {"vocab_size": 80}
        tokens = rng.integers(0, 80, (b, 129)).astype(np.int32)
        batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    model = models.build_model(mc, input_shape=shape, rngs=nnx.Rngs(0), verbose=False, **kw)
    graphdef, params, rest = models.split_model(model)
    return models.make_loss_fn(graphdef, rest, task), params, batch


def _optax_runner(loss_fn, params, batch, lr: float, *, grad_norm: bool = False):
    tx = optax.adam(lr)

    @jax.jit
    def init(p):
        return p, tx.init(p)

    def train_step(carry, batch):
        p, s = carry
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), ((loss, optax.tree.norm(g)) if grad_norm
                                                 else loss)

    jitted = jax.jit(train_step, donate_argnums=0)
    carry = init(params)

    def run(n):
        nonlocal carry
        for _ in range(n):
            carry, loss = jitted(carry, batch)
        return loss

    return run


def _cbs_runner(loss_fn, params, batch, lr: float, *, accum: int = 1, live: str = "auto",
                measure=None, grad_norm: bool = True):
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    direction = optim.make_direction(ml_collections.ConfigDict({"name": "adam"}))
    rep = mesh_lib.replicated(mesh)
    state = jax.jit(lambda p: init_train_state(p, direction, learning_rate=lr),
                    out_shardings=rep)(params)
    b = jax.tree.leaves(batch)[0].shape[0]
    layout = step.BatchLayout(mesh, jax.tree.map(lambda x: x.sharding, state),
                              mesh_lib.batch_sharding(mesh), micro_batch=b // accum)
    ts = step.TrainStep(stateless(loss_fn), direction, lambda lr, e, b: lr, layout,
                        step.StepOptions(live=live, grad_norm=grad_norm))
    measurement = None if measure is None else Measurement(measure, ts, seed=0)
    t = 0

    def run(n):
        nonlocal state, t
        for _ in range(n):
            if measurement is None:
                state, metrics = ts(state, batch, accum)
            else:
                state, (metrics, _) = measurement.step(state, batch, accum, t)
            t += 1
        return metrics

    return run, ts.live_kind(state, batch, accum)


def _time(run, steps: int) -> float:
    """Seconds per step of one run of `steps` steps, blocking on the last."""
    start = time.perf_counter()
    jax.block_until_ready(run(steps))
    return (time.perf_counter() - start) / steps


# (variant, baseline it is compared with, target of the ratio)
VARIANTS = (
    ("cbs (no estimate, no grad norm)", "optax", "≥ 0.97× speed"),
    ("cbs (no estimate)", "optax + grad norm", "≥ 0.97× speed"),
    ("cbs (no estimate)", "optax", ""),
    ("cbs + live", "cbs (no estimate)", "≤ 1.05×"),
    ("cbs + two-batch (halves)", "cbs (no estimate)", ""),
    ("cbs + live + exact/10", "cbs + live", "≤ 1.03×"),
    ("cbs + two-batch + exact/10 (jit)", "cbs + two-batch (halves)", ""),
    ("cbs A=2 (no estimate)", "optax", ""),
    ("cbs A=2 + live", "cbs A=2 (no estimate)", "≤ 1.05×"),
)


def _steps_per_run(run, steps: int, every: int, min_seconds: float) -> int:
    """Steps in one timed run: at least `steps`, enough for `min_seconds` (a 3 ms step timed
    over 20 steps is mostly the machine's scheduling noise), a multiple of `every` (each run of
    an every-k-steps measurement then holds the same number of measurements)."""
    per_step = _time(run, steps)
    n = max(steps, math.ceil(min_seconds / per_step))
    return -(-n // every) * every


def bench(name: str, steps: int, repeats: int, every: int, min_seconds: float
          ) -> tuple[dict, dict, dict, int]:
    """(seconds per step of every run of each variant, the ratio of each `VARIANTS` pair per
    repeat, the live estimator of each variant, steps per run).

    A pair's ratio in one repeat comes from four adjacent runs, baseline, variant, variant,
    baseline (ABBA): a load that drifts linearly over them cancels in (v₁ + v₂)/(b₁ + b₂)."""
    loss_fn, params, batch = _model(name)
    batch = jax.device_put(batch)
    measure = NoiseSpec(method="fast", every=every)  # the whole batch (A = 1: one micro-batch)
    runner = lambda **kw: _cbs_runner(loss_fn, params, batch, 1e-3, **kw)
    variants = {
        "optax": (_optax_runner(loss_fn, params, batch, 1e-3), "-"),
        "optax + grad norm": (_optax_runner(loss_fn, params, batch, 1e-3, grad_norm=True), "-"),
        "cbs (no estimate)": runner(live="none"),
        "cbs (no estimate, no grad norm)": runner(live="none", grad_norm=False),
        "cbs + live": runner(),
        "cbs + two-batch (halves)": runner(live="two_batch"),
        f"cbs + live + exact/{every}": runner(measure=measure),
        f"cbs + two-batch + exact/{every} (jit)": runner(live="two_batch", measure=measure),
        "cbs A=2 (no estimate)": runner(accum=2, live="none"),
        "cbs A=2 + live": runner(accum=2),
    }
    for run, _ in variants.values():  # compile and warm up (covers a measurement)
        jax.block_until_ready(run(max(steps, every)))
    n = _steps_per_run(variants["optax"][0], steps, every, min_seconds)
    times: dict[str, list[float]] = {k: [] for k in variants}
    ratios: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for variant, base, _ in _pairs(every):
            t = {}
            for k, label in ((base, "b1"), (variant, "v1"), (variant, "v2"), (base, "b2")):
                t[label] = _time(variants[k][0], n)
                times[k].append(t[label])
            cost = (t["v1"] + t["v2"]) / (t["b1"] + t["b2"])
            # against the hand-written loop a speed ratio (optax / cbs), else a cost ratio
            ratios.setdefault((variant, base), []).append(
                1 / cost if base.startswith("optax") else cost)
    return times, ratios, {k: kind for k, (_, kind) in variants.items()}, n


def verdict(target: str, ratios: list[float]) -> str:
    """`target` ("≤ 1.05×", "≥ 0.97× speed") judged on a pair's ratios over the repeats: "met"
    or "not met" when every repeat agrees, else the median's side and that the repeats
    straddle the bound (the machine's noise exceeds the difference)."""
    if not target:
        return ""
    bound = float(target.split()[1].rstrip("×"))
    ok = (lambda r: r <= bound) if target.startswith("≤") else (lambda r: r >= bound)
    if all(map(ok, ratios)):
        return "met"
    if not any(map(ok, ratios)):
        return "not met"
    side = "met" if ok(statistics.median(ratios)) else "not met"
    return f"median {side}; repeats straddle it (noise)"


def _pairs(every: int):
    return [(v.replace("/10", f"/{every}"), b.replace("/10", f"/{every}"), target)
            for v, b, target in VARIANTS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--models", default="mlp,cnn,transformer,lm")
    parser.add_argument("--repeats", type=int, default=0, help="0: 7 (quick) or 11")
    parser.add_argument("--min-seconds", type=float, default=0.0,
                        help="shortest timed run (0: 0.3 s quick, 1 s full)")
    args = parser.parse_args()
    steps, repeats, every, min_s = (10, 7, 10, 0.3) if args.quick else (50, 11, 10, 1.0)
    repeats, min_s = args.repeats or repeats, args.min_seconds or min_s
    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"{repeats} repeats of ABBA runs of ≥ {min_s} s (steps per run below)\n")
    print("| model | variant | live | steps/run | ms/step (median) | vs | "
          "ratio median [min, max] | target | verdict |")
    print("|---|---|---|---:|---:|---|---|---|---|")
    for name in args.models.split(","):
        times, ratios, kinds, n = bench(name, steps, repeats, every, min_s)
        for variant, base, target in _pairs(every):
            r = ratios[(variant, base)]
            ms = statistics.median(times[variant]) * 1e3
            print(f"| {name} | {variant} | {kinds[variant]} | {n} | {ms:.2f} | {base} | "
                  f"{statistics.median(r):.3f} [{min(r):.3f}, {max(r):.3f}] | {target} | "
                  f"{verdict(target, r)} |", flush=True)
        for base in ("optax", "optax + grad norm"):
            print(f"| {name} | {base} | - | {n} | {statistics.median(times[base]) * 1e3:.2f} "
                  "| | | | |", flush=True)


if __name__ == "__main__":
    main()
