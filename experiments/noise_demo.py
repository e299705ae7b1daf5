"""Noise scale of a digits MLP at a few points of training, by every estimator.

    python -m experiments.noise_demo [--steps=0,20,50,100,200] [--batch_size=1438]

Trains the 64-128-128-10 MLP of `experiments/configs/digits_mlp.py` (Adam, B = 128) and at
each listed step measures, on a fixed batch of training examples (default: the whole
training set): B_simple exact (per-example gradients: the fast ghost-norm path and vmap),
with 8 random probes, and by the two-batch estimator from the batch's two halves; B_noise
exact on its first `--curvature_batch_size` examples (O(n²) HVPs) and with 8 probes on all.
Prints one table row per step. A measurement is only as good as its batch is large compared
with the noise scale: once B_simple ≫ n, |G|² is buried in noise and the estimates scatter
(they can even turn negative), which is why cbs averages numerators and denominators
over time (NoiseScaleEMA) or over a window before dividing.
"""

from __future__ import annotations

import time

import jax
from absl import flags, logging

from cbs import models
from cbs.data import batching
from cbs.engine.parts import RunParts
from cbs.runtime import cli
from cbs.stats import noise, smoothing, trees

_STEPS = flags.DEFINE_list("steps", ["0", "20", "50", "100", "200"], "Steps to measure at.")
_BATCH = flags.DEFINE_integer("batch_size", 1438, "Training examples per measurement.")
_CURV = flags.DEFINE_integer("curvature_batch_size", 256, "Examples for exact B_noise.")


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    from experiments.configs import digits_mlp

    c = digits_mlp.get_config("")
    c.noise.every = 0
    c.train.progress_bar = False
    runner = RunParts(c)
    state = runner.init_state()
    batch = batching.device_batch(runner.dataset, runner.train_arrays, 0, _BATCH.value, seed=99)
    loss_fn = models.make_loss_fn(runner.graphdef, state.model_state, runner.dataset.task)
    stats_fn = jax.jit(lambda p: {
        "fast": noise.exact(loss_fn, p, batch, method="fast"),
        "vmap": noise.exact(loss_fn, p, batch, method="vmap", chunk_size=128),
        "curv": noise.exact(loss_fn, p, jax.tree.map(lambda x: x[:_CURV.value], batch),
                            curvature=True, chunk_size=64),
        "probe": noise.probe(loss_fn, p, batch, jax.random.key(0), num_probes=8,
                             curvature=True)})
    half = _BATCH.value // 2
    halves = [jax.tree.map(lambda x, i=i: x[i * half:(i + 1) * half], batch) for i in (0, 1)]
    two_batch = jax.jit(lambda p: smoothing.two_batch(
        0.5 * sum(_sq_grad(loss_fn, p, h) for h in halves), _sq_grad(loss_fn, p, batch),
        half, 2 * half))
    accum = runner.accum_steps(c.batch.schedule.batch_size)
    print(f"digits MLP, Adam B={c.batch.schedule.batch_size}; measured on {_BATCH.value} "
          "training examples\n")
    print("| step | train loss | B_simple fast | B_simple vmap | B_simple probe(8) | "
          f"B_simple two-batch | B_noise exact (n={_CURV.value}) | B_noise probe(8) | s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    step = 0
    for target in sorted(int(s) for s in _STEPS.value):
        while step < target:
            state, _ = runner.step(state, runner.inputs(0, 0), accum)
            step += 1
        start = time.perf_counter()
        out = jax.device_get(stats_fn(state.params))
        g2, tr = jax.device_get(two_batch(state.params))
        loss = runner.evaluate(state)["loss"]
        f, v, p, h = out["fast"], out["vmap"], out["probe"], out["curv"]
        print(f"| {step} | {loss:.3f} | {f.b_simple:.1f} | {v.b_simple:.1f} | "
              f"{p.b_simple:.1f} | {tr / g2:.1f} | {h.b_noise:.1f} | {p.b_noise:.1f} | "
              f"{time.perf_counter() - start:.2f} |")


def _sq_grad(loss_fn, params, batch):
    return trees.tree_sq_norm(jax.grad(loss_fn)(params, batch))


if __name__ == "__main__":
    cli.run(main)
