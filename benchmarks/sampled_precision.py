"""What each draw of the sampled noise estimator costs in standard error, on a committed study.

    python -m benchmarks.sampled_precision   # results/shakespeare_kaplan_d32 (~5 min, 2 cores)
    python -m benchmarks.sampled_precision --quick   # results/digits, small n, m, h

The estimator of the reference protocol over seeds for a large training set
(`cbs.stats.sampled.measure_noise`; `python -m experiments.reference --examples=n
--deviations=m --hessian_examples=h`): G, |G|² and tr(Σ) from n examples 𝓑, tr(HΣ) from the
deviations of the first m of them, with the Hessian of h examples 𝓒 drawn independently. The
study's model is trained for `--steps` steps of AdamW at B = `--batch_size` (a point in
training, not the study's trajectory), then measured `--repeats` times

- with every draw new (𝓑 and 𝓒): the standard error of one measurement;
- with 𝓑 fixed and only 𝓒 new: the part the Hessian draw adds;

and each measurement is timed (median after a warm-up). Prints, per statistic, the mean, the
relative standard error of one measurement, the Hessian draw's part of it, and the seconds.

With `--by_leaf`, also where B_simple^P = tr(PΣ)/GᵀPG of AdamW's update comes from (P the
bias-corrected Adam preconditioner of the optimizer state, `cbs.stats.preconditioned`): per
params leaf, its share of tr(PΣ) and of GᵀPG and its own ratio, from the per-example
gradients of n examples (vmap), beside the plain tr(Σ)/|G|² of the same examples.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import full_data_cost
from cbs.runtime import cli
from cbs.stats import preconditioned, sampled
from cbs.sweeps import reference_seeds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("trace_sigma", "grad_sq_norm", "b_simple", "trace_h_sigma", "g_h_g", "b_noise")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep_dir", default=None, help="a committed study (default: "
                        "results/shakespeare_kaplan_d32; results/digits with --quick)")
    parser.add_argument("--examples", type=int, default=4096, help="n")
    parser.add_argument("--deviations", type=int, default=reference_seeds.SAMPLED_DEVIATIONS,
                        help="m")
    parser.add_argument("--hessian_examples", type=int,
                        default=reference_seeds.HESSIAN_EXAMPLES, help="h")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600, help="training steps before")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=0.006)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--by_leaf", action="store_true",
                        help="also B_simple^P of AdamW's update, leaf by leaf")
    args = parser.parse_args(argv)
    if args.quick:
        args.examples, args.deviations, args.hessian_examples = 256, 16, 64
        args.repeats, args.steps = 3, 100
    sweep_dir = args.sweep_dir or os.path.join(
        ROOT, "results", "digits" if args.quick else "shakespeare_kaplan_d32")
    config, state, loss_fn, ds = full_data_cost.study_model(sweep_dir)
    num = ds.num_train
    train = ds.split("train")
    rng = np.random.default_rng(0)
    read = lambda size: jax.tree.map(jnp.asarray, train.read(
        np.sort(rng.choice(num, size, replace=False))))

    opt = optax.adamw(args.learning_rate, weight_decay=float(config.optim.weight_decay))
    params, opt_state = state.params, opt.init(state.params)

    @jax.jit
    def step(p, s, b):
        g = jax.grad(loss_fn)(p, b)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    for _ in range(args.steps):
        params, opt_state = step(params, opt_state, read(args.batch_size))
    loss = float(jax.jit(loss_fn)(params, read(min(num, 4096))))

    n, m, h = args.examples, args.deviations, args.hessian_examples
    measure = jax.jit(lambda p, b, c: sampled.measure_noise(loss_fn, p, b, c, deviations=m,
                                                            chunk_size=min(1024, n)))
    jax.block_until_ready(measure(params, read(n), read(h)))  # warm-up
    fresh, hessian_only, seconds = [], [], []
    fixed = read(n)
    for _ in range(args.repeats):
        b, c = read(n), read(h)
        t = time.perf_counter()
        out = jax.block_until_ready(measure(params, b, c))
        seconds.append(time.perf_counter() - t)
        fresh.append({k: float(out[k]) for k in KEYS})
        out = measure(params, fixed, read(h))
        hessian_only.append({k: float(out[k]) for k in KEYS})
    name = os.path.basename(os.path.normpath(sweep_dir))
    print(f"{name}: N = {num:,}, after {args.steps} AdamW steps at B = {args.batch_size} "
          f"(loss {loss:.3f}); n = {n:,}, m = {m}, h = {h}; {args.repeats} repeats, "
          f"{jax.devices()[0].platform}; one measurement {statistics.median(seconds):.1f} s "
          "(median)\n")
    print("| statistic | mean | relative SE of one measurement | of it, the Hessian draw's |")
    print("|---|---|---|---|")
    for k in KEYS:
        a = np.asarray([r[k] for r in fresh])
        hh = np.asarray([r[k] for r in hessian_only])
        mean = float(np.mean(a))
        rel = lambda x, mu=mean: float(np.std(x, ddof=1) / abs(mu)) if mu else float("nan")
        part = "–" if k in ("trace_sigma", "grad_sq_norm", "b_simple") else f"{rel(hh):.1%}"
        print(f"| {k} | {mean:.4g} | {rel(a):.1%} | {part} |")
    if args.by_leaf:
        p = preconditioned.adam_preconditioner(opt_state, eps=1e-8, b2=0.999)
        _by_leaf(loss_fn, params, p, read(n), min(n, 1024))
    return 0


def _by_leaf(loss_fn, params, precond, batch, chunk: int) -> None:
    """Per leaf: tr(P Σ) and GᵀPG (unbiased, from per-example gradients) and their shares."""
    one = lambda q, x: loss_fn(q, jax.tree.map(lambda a: a[None], x))
    per = jax.jit(lambda q, b: jax.vmap(jax.grad(one), in_axes=(None, 0))(q, b))
    n = jax.tree.leaves(batch)[0].shape[0]
    sums = None
    for start in range(0, n, chunk):
        g = per(params, jax.tree.map(lambda a, i=start: a[i:i + chunk], batch))
        s1 = jax.tree.map(lambda x: jnp.sum(x, 0), g)
        s2 = jax.tree.map(lambda x, w: jnp.sum(x * x, 0) * w, g, precond)
        s0 = jax.tree.map(lambda x: jnp.sum(x * x, 0), g)
        part = (s1, s2, s0)
        sums = part if sums is None else jax.tree.map(jnp.add, sums, part)
    s1, s2, s0 = sums
    rows, total = [], {"tps": 0.0, "gpg": 0.0, "ts": 0.0, "gg": 0.0}
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
    for name, a, b, c, w in zip(names, jax.tree.leaves(s1), jax.tree.leaves(s2),
                                jax.tree.leaves(s0), jax.tree.leaves(precond), strict=True):
        mean = a / n
        # unbiased: tr(WΣ) = (Σ w·g² − n·w·ḡ²)/(n − 1), GᵀWG = w·ḡ² − tr(WΣ)/n (per coordinate)
        tps = float(jnp.sum(b - n * w * mean**2) / (n - 1))
        gpg = float(jnp.sum(w * mean**2)) - tps / n
        ts = float(jnp.sum(c - n * mean**2) / (n - 1))
        gg = float(jnp.sum(mean**2)) - ts / n
        rows.append((name, tps, gpg, ts, gg, float(jnp.max(w)), float(jnp.median(w))))
        for k, v in zip(("tps", "gpg", "ts", "gg"), (tps, gpg, ts, gg), strict=True):
            total[k] += v
    print(f"\nB_simple^P of AdamW's update by params leaf (n = {n:,} examples): whole "
          f"B_simple^P = {total['tps'] / total['gpg']:.4g}, B_simple = "
          f"{total['ts'] / total['gg']:.4g}\n")
    print("| leaf | share of tr(PΣ) | share of GᵀPG | its tr(PΣ)/GᵀPG | its tr(Σ)/|G|² | "
          "P max / median |")
    print("|---|---|---|---|---|---|")
    for name, tps, gpg, ts, gg, pmax, pmed in sorted(rows, key=lambda r: -r[1])[:8]:
        ratio = lambda a, b: f"{a / b:.3g}" if b > 0 else "–"
        print(f"| {name} | {tps / total['tps']:.1%} | {gpg / total['gpg']:.1%} | "
              f"{ratio(tps, gpg)} | {ratio(ts, gg)} | {pmax:.3g} / {pmed:.3g} |")


if __name__ == "__main__":
    cli.guarded(lambda argv: main(argv[1:]))(sys.argv)  # user errors: one line, status 2
