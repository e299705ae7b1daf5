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

from cbs import data
from cbs.engine import cli, mesh, trainer
from cbs.stats import sampled
from cbs.sweeps import grid, reference_seeds, trials

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
    args = parser.parse_args(argv)
    if args.quick:
        args.examples, args.deviations, args.hessian_examples = 256, 16, 64
        args.repeats, args.steps = 3, 100
    sweep_dir = args.sweep_dir or os.path.join(
        ROOT, "results", "digits" if args.quick else "shakespeare_kaplan_d32")
    config = reference_seeds.study_config(sweep_dir)
    trial = grid.make_trials(config.sweep)[0]
    one = mesh.make_mesh(data=1, model=1, devices=jax.devices()[:1])
    tr = trainer.Trainer(trials.trial_config(config, trial), mesh=one)
    state = tr.init_state()
    loss_fn = lambda p, b: tr.loss_fn(p, state.model_state, b)[0]
    ds = data.get_dataset(config.data.name, **config.data.options.to_dict())
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
    return 0


if __name__ == "__main__":
    cli.guarded(lambda argv: main(argv[1:]))(sys.argv)  # user errors: one line, status 2
