"""Sweep throughput: K learning rates of one batch size as one vmapped program vs one by one.

    python -m benchmarks.sweep_throughput            # B in {16, 256}, K in {1, 4}
    python -m benchmarks.sweep_throughput --quick    # fewer steps and repeats

On the digits MLP (64-128-128-10, Adam), every variant trains the same K trials for the same
number of steps (targets out of reach, divergence detection off, so no trial stops early)
with 40 evaluations of the full training-set loss each and no noise measurements (the two
back ends measure noise differently; the rows compare training and evaluation only):

- `vmap K`: `cbs.sweeps.groups.TrialGroup` with all K learning rates in one program;
- `1 × K`: the same group class with one learning rate at a time, K times (isolates the
  vmap: same step, same evaluations, K dispatch streams);
- `engine × K`: `cbs.sweeps.trials.run_trial_engine` for each trial (the general path: host loop,
  linear evaluation grid, checkpoints, records).

Wall time is what a sweep pays for those trials, compilation included (every group and every
engine trial builds and compiles its own step, as in a real sweep): the median of repeats,
each from fresh objects, after one warm-up of the whole variant (imports, dataset, JAX
start-up). The speed-up column is against `engine × K`. What the runs print (the engine's
model summary, progress) is swallowed so that the table stays one block.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time

import jax

from cbs.results import store
from cbs.runtime import mesh
from cbs.sweeps import grid, groups, trials
from experiments.configs import digits_sweep


def _config(batch_size: int, k: int, steps: int):
    c = digits_sweep.get_config("")
    s = c.sweep
    s.batch_sizes = (batch_size,)
    s.lr_factors = tuple(2.0 ** (i - 1) for i in range(k))
    s.max_lr = 0.0
    s.targets = (1e-6,)  # out of reach: every trial runs the whole budget
    s.max_steps, s.max_examples = steps, 0
    s.evals_per_trial = 40
    s.divergence_factor = 0.0  # off: every trial runs the whole budget
    c.noise.examples = "step"  # no noise measurements at the evaluations
    s.noise_protocol = "per_trial"  # so no reference trajectory at a B outside this grid
    c.train.progress_bar = False  # the table is the output
    return c


def _quiet(fn) -> None:
    """fn() with its prints (model summaries, per-trial lines) kept out of the table."""
    with contextlib.redirect_stdout(io.StringIO()):
        fn()


def _time(fn, repeats: int) -> float:
    _quiet(fn)  # warm-up: imports, dataset loading, JAX start-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _quiet(fn)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(batch_size: int, k: int, steps: int, repeats: int) -> list[tuple[str, float]]:
    c = _config(batch_size, k, steps)
    trial_list = grid.make_trials(c.sweep)
    one = mesh.make_mesh(data=1, model=1, devices=jax.devices()[:1])

    def vmapped():
        with tempfile.TemporaryDirectory() as d:
            groups.TrialGroup(c, trial_list, store.SweepStore(d)).run()

    def one_by_one():
        with tempfile.TemporaryDirectory() as d:
            cache: dict = {}  # the evaluation compiles once, as in a sweep
            for t in trial_list:
                groups.TrialGroup(c, [t], store.SweepStore(d), cache=cache).run()

    def engine():
        with tempfile.TemporaryDirectory() as d:
            for t in trial_list:
                trials.run_trial_engine(c, t, store.SweepStore(d), mesh=one)

    rows = [(f"vmap {k}", _time(vmapped, repeats))]
    if k > 1:
        rows.append((f"1 × {k}", _time(one_by_one, repeats)))
    rows.append((f"engine × {k}", _time(engine, repeats)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    args = parser.parse_args()
    steps, repeats = (1000, 1) if args.quick else (3000, 3)
    print(f"digits MLP, {steps} steps per trial, 40 evaluations of the full training loss; "
          f"device: {jax.devices()[0].platform}; compilation included; median of {repeats}\n")
    print("| B | K | variant | wall s | trial-steps/s | speed-up vs engine |")
    print("|---:|---:|---|---:|---:|---:|")
    for batch_size in (16, 256):
        for k in (1, 4):
            rows = bench(batch_size, k, steps, repeats)
            base = rows[-1][1]
            for name, t in rows:
                print(f"| {batch_size} | {k} | {name} | {t:.2f} | {k * steps / t:,.0f} | "
                      f"{base / t:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
