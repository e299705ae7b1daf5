"""Cost of the reference protocol's whole-training-set measurement on a committed study.

    python -m benchmarks.full_data_cost       # results/shakespeare_kaplan_d32 (~4 min, 2 CPU cores)
    python -m benchmarks.full_data_cost --sweep_dir=results/mnist1d_adam --repeats=5
    python -m benchmarks.full_data_cost --quick   # results/digits, 2 repeats, no memory rows

The study's model (its config from sweep.json, at initialisation) and its whole training set of
N examples. Timed, as the median of `--repeats` calls after one warm-up, each jitted on one
chunk of `cbs.stats.sampled.FULL_DATA_CHUNK` examples (the chunks the measurement sums over
for N > `FULL_DATA_ONE_PASS`) and scaled by N/chunk:

- gradient: ∇L over the N examples, the unit of the ratio column;
- per-example norms: `cbs.stats.ghost.per_example_grads_info` (tr(Σ) and |G|²);
- HVP: one Hessian-vector product of the mean loss over the N examples (jvp of the gradient);
- one evaluation of the protocol (`cbs.sweeps.reference_seeds`): the norms, GᵀHG and the 256
  deviations' HVPs with the full-data Hessian; for Adam/AdamW twice (the update's statistics
  too);
- the same with the Hessian of an independent subset of one chunk (`hessian_examples`, still
  unbiased): GᵀHG over N, the 256 deviations' HVPs over the subset.

Memory (not with --quick): the temporaries of the compiled whole measurement (256 deviations)
from XLA's memory analysis, nothing allocated: one pass over all N, and in chunks.
Prints a markdown table.
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

from cbs import data
from cbs.engine import trainer
from cbs.runtime import cli, mesh
from cbs.stats import ghost, sampled
from cbs.sweeps import grid, reference_seeds, trials

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVIATIONS = reference_seeds.DEVIATIONS


def _median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # warm-up (compilation)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _temp_gb(loss_fn, params, num: int, example, one_pass: bool) -> float:
    """Temporaries of the compiled measurement over `num` examples like `example`."""
    batch = {k: jax.ShapeDtypeStruct((num, *v.shape[1:]), v.dtype) for k, v in example.items()}
    fn = jax.jit(lambda p, b, k: sampled.measure_full_data(loss_fn, p, b, k,
                                                           deviations=DEVIATIONS))
    saved = sampled.FULL_DATA_ONE_PASS
    sampled.FULL_DATA_ONE_PASS = 10**12 if one_pass else 0
    try:
        compiled = fn.lower(params, batch, jax.random.key(0)).compile()
    finally:
        sampled.FULL_DATA_ONE_PASS = saved
    return compiled.memory_analysis().temp_size_in_bytes / 1e9


def study_model(sweep_dir: str):
    """(config, initial train state, loss_fn(params, batch), dataset) of the committed study
    in `sweep_dir`: its first trial's model on one device."""
    config = reference_seeds.study_config(sweep_dir)
    trial = grid.make_trials(config.sweep)[0]
    one = mesh.make_mesh(data=1, model=1, devices=jax.devices()[:1])
    tr = trainer.Trainer(trials.trial_config(config, trial), mesh=one)
    state = tr.init_state()
    loss_fn = lambda p, b: tr.loss_fn(p, state.model_state, b)[0]
    ds = data.get_dataset(config.data.name, **config.data.options.to_dict())
    return config, state, loss_fn, ds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep_dir", default=None, help="a committed study (default: "
                        "results/shakespeare_kaplan_d32; results/digits with --quick)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="digits, 2 repeats, no memory")
    args = parser.parse_args(argv)
    sweep_dir = args.sweep_dir or os.path.join(
        ROOT, "results", "digits" if args.quick else "shakespeare_kaplan_d32")
    repeats = 2 if args.quick else args.repeats
    config, state, loss_fn, ds = study_model(sweep_dir)
    num = ds.num_train
    chunk = min(sampled.FULL_DATA_CHUNK, num)
    batch = jax.tree.map(jnp.asarray, ds.split("train").read(np.arange(chunk)))
    params = state.params
    grad = jax.jit(jax.grad(loss_fn))
    hvp = jax.jit(lambda p, v, b: jax.jvp(lambda q: jax.grad(loss_fn)(q, b), (p,), (v,))[1])
    norms = jax.jit(lambda p, b: ghost.per_example_grads_info(loss_fn, p, b)[2])
    scale = num / chunk
    t_grad = _median_seconds(lambda: grad(params, batch), repeats) * scale
    t_norms = _median_seconds(lambda: norms(params, batch), repeats) * scale
    t_hvp = _median_seconds(lambda: hvp(params, params, batch), repeats) * scale
    t_subset_hvp = t_hvp / scale
    adaptive = str(config.optim.name) in reference_seeds.ADAPTIVE
    times = 2 if adaptive else 1
    full = times * (t_norms + (1 + DEVIATIONS) * t_hvp)
    subset = times * (t_norms + t_hvp + DEVIATIONS * t_subset_hvp)
    name = os.path.basename(os.path.normpath(sweep_dir))
    params_count = sum(x.size for x in jax.tree.leaves(params))
    print(f"{name}: N = {num:,} examples, {params_count:,} parameters, "
          f"{config.optim.name}; chunks of {chunk:,}; {jax.devices()[0].platform}, "
          f"median of {repeats} after a warm-up\n")
    print("| over the whole training set | seconds | / gradient |")
    print("|---|---|---|")
    rows = [("gradient", t_grad), ("per-example norms", t_norms), ("HVP", t_hvp),
            (f"one evaluation: {DEVIATIONS} deviations, full-data Hessian"
             f"{' (×2: the update too)' if adaptive else ''}", full),
            (f"one evaluation: Hessian of {chunk:,} independent examples"
             f"{' (×2)' if adaptive else ''}", subset)]
    shown = lambda x: f"{x:,.0f}" if x >= 100 else f"{x:.3g}"
    for label, seconds in rows:
        print(f"| {label} | {shown(seconds)} | {shown(seconds / t_grad)} |")
    if not args.quick:
        example = {k: v[:1] for k, v in batch.items()}
        one_pass = _temp_gb(loss_fn, params, num, example, one_pass=True)
        chunked = _temp_gb(loss_fn, params, num, example, one_pass=False)
        print(f"\nCompiled temporaries of the whole measurement ({DEVIATIONS} deviations): "
              f"{one_pass:,.1f} GB in one pass over N (the deviations side by side), "
              f"{chunked:,.2f} GB in chunks of {chunk:,} (the deviations one by one).")
    return 0


if __name__ == "__main__":
    cli.guarded(lambda argv: main(argv[1:]))(sys.argv)  # user errors: one line, status 2
