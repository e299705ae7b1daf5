"""The noise measurement of a sweep trial at its evaluations: one function for both back ends.

A trial's `j`-th evaluation measures on batches that depend only on (seed, j)
(`cbs.engine.measure.measurement_batches`: 𝓑 of `sweep.noise_batch_size` examples from a
stream independent of training's, 𝓒 an independent Hessian draw of
`sweep.noise_hessian_batch_size`), or on the whole training set (`sweep.noise_examples`), with
the registered noise method "sampled" (`cbs.stats.sampled`, which a single run selects with
`noise.method = "sampled"`) or the whole-training-set estimator there. What is measured is a
typed `SweepNoise` (from `config.sweep`, or the reference run's). A vmapped group
(`cbs.sweeps.groups.TrialGroup`) calls `state_measurement` inside its vmapped evaluation; an
engine trial (`cbs.sweeps.trials.run_trial_engine`) records `EngineMeasurement` at each of its
evaluations through the trainer's `on_eval` hook, with the in-step `noise.every` off. The same
(seed, j) gives the same draws, so the two back ends record the same `noise/*` values at an
evaluation with the same index.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from cbs import data
from cbs.engine import measure, mesh
from cbs.engine.parts import RunParts
from cbs.engine.step import TrainState
from cbs.stats import noise as noise_lib
from cbs.stats import sampled

StateMeasurement = Callable[[TrainState, jax.Array], dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class SweepNoise:
    """How a sweep measures the noise at each evaluation: the `config.sweep.noise_*` fields
    (`from_sweep`), or the reference run's protocol (`cbs.sweeps.reference`).

    batch_size: n, examples of 𝓑 (0: no measurement); curvature_batch_size: m, the
    deviations that give tr(HΣ) (0: no B_noise); hessian_batch_size: h, examples of the
    independent Hessian draw 𝓒 (with the whole training set, 0: all N); examples: "sampled",
    "all" or "auto" (`cbs.engine.measure.uses_full_data`); chunk_size: examples per vmap
    chunk (0: all at once).
    """

    batch_size: int
    curvature_batch_size: int
    hessian_batch_size: int
    examples: str = "sampled"
    chunk_size: int = 0

    @classmethod
    def from_sweep(cls, sweep: ml_collections.ConfigDict) -> SweepNoise:
        return cls(int(sweep.noise_batch_size), int(sweep.noise_curvature_batch_size),
                   int(sweep.get("noise_hessian_batch_size", 0)),
                   str(sweep.get("noise_examples", "sampled")),
                   int(sweep.get("noise_chunk_size", 0)))

    @property
    def hessian_draw(self) -> int:
        """h of a sampled measurement's 𝓒 (0 without curvature)."""
        return self.hessian_batch_size if self.curvature_batch_size else 0


def sweep_measurement(noise: SweepNoise, loss_fn, params, dataset, arrays, index: Any, *,
                      seed: int) -> dict[str, jax.Array]:
    """The noise measurement a sweep trial records at its `index`-th evaluation (jittable):
    `cbs.engine.measure.measure_noise` on `noise.batch_size` examples of a measurement
    stream (`seed`) and, when `noise.curvature_batch_size` > 0, B_noise from the deviations of
    that many of them and the Hessian of an independent draw of `noise.hessian_batch_size`
    examples. With `noise.examples` "all" (or "auto" and at most `measure.FULL_DATA_MAX`
    training examples): `measure.measure_full_data` on the whole training set, tr(HΣ) from
    `noise.curvature_batch_size` random deviations and the Hessian of
    `noise.hessian_batch_size` independent examples (0: all). `arrays`: the training split's
    stored arrays (device or, for `host_batches`, numpy)."""
    if measure.uses_full_data(noise.examples, dataset.num_train):
        everything = dataset.take(arrays, jnp.arange(dataset.num_train, dtype=jnp.int32))
        return _measure(noise, loss_fn, params, everything, None,
                        measure.measurement_key(seed, index))
    grad_batch, hess_batch = measure.measurement_batches(
        dataset, arrays, index, seed=seed, batch_size=noise.batch_size,
        hessian_batch_size=noise.hessian_draw)
    return _measure(noise, loss_fn, params, grad_batch, hess_batch, None)


def _loss_at(tr: RunParts, state: TrainState) -> Callable:
    """loss_fn(params, batch) -> mean loss, with the state's model state (BatchNorm etc.)."""
    return lambda p, b: tr.loss_fn(p, state.model_state, b)[0]


def _measure(noise: SweepNoise, loss_fn, params, grad_batch, hess_batch, key
             ) -> dict[str, jax.Array]:
    """The statistics of drawn batches: full data when `key` is given, else the registered
    noise method "sampled" (`cbs.stats.sampled.sampled_method`) on (𝓑, 𝓒), the method a
    single run selects with `noise.method = "sampled"`. mean_grad_sq_norm is left out (a
    sweep records the unbiased grad_sq_norm)."""
    curv, chunk = noise.curvature_batch_size, noise.chunk_size or None
    if key is not None:
        out = measure.measure_full_data(
            loss_fn, params, grad_batch, key, deviations=curv, chunk_size=chunk,
            hessian_examples=noise.hessian_batch_size)
    else:
        method = noise_lib.get_method(sampled.SAMPLED_METHOD)
        stats = method(loss_fn, params, grad_batch, curvature=hess_batch is not None,
                       hessian_batch=hess_batch, deviations=curv, chunk_size=chunk)
        out = {k: jnp.asarray(v, jnp.float32) for k, v in stats.to_dict(prefix="").items()}
    out.pop("mean_grad_sq_norm")
    return out


def state_measurement(noise: SweepNoise, tr: RunParts, *, seed: int) -> StateMeasurement:
    """fn(state, index) -> the statistics of `sweep_measurement` (keys without the `noise/`
    prefix) at the trial's parameters, on the parts' device-resident training arrays
    (jittable and vmappable over states)."""

    def fn(state: TrainState, index: jax.Array) -> dict[str, jax.Array]:
        return sweep_measurement(noise, _loss_at(tr, state), state.params, tr.dataset,
                                 tr.train_arrays, index, seed=seed)

    return fn


def host_batches(noise: SweepNoise, dataset: data.Dataset, index: int, *,
                 seed: int) -> tuple[Any, Any]:
    """(𝓑, 𝓒) of the `index`-th measurement read on the host from a streamed training split:
    the examples `measure.measurement_batches` gathers on the device (all N with full data,
    then 𝓒 is None)."""
    train = dataset.split("train")
    num = dataset.num_train
    if measure.uses_full_data(noise.examples, num):
        return train.read(np.arange(num)), None
    n = min(noise.batch_size, num)
    grad_batch = data.host_batch(dataset, index * n, n, seed=seed + measure.SEED_OFFSET)
    h = min(noise.hessian_draw, num)
    if not h:
        return grad_batch, None
    idx_h = np.asarray(jax.random.choice(measure.measurement_key(seed, index), num, (h,),
                                         replace=False)).astype(np.int32)
    return grad_batch, train.read(idx_h)


class EngineMeasurement:
    """The `on_eval` hook (`cbs.engine.trainer.run`) of an engine trial: at the evaluation
    after `step` updates, {"noise/ema_b_simple", "noise/<key>" of `sweep_measurement`} at the
    evaluation's index on the trial's grid `steps` (`cbs.sweeps.trials.eval_steps`, the grid
    of a vmapped group; a final evaluation between grid points gets the next index)."""

    def __init__(self, noise: SweepNoise, *, seed: int, steps: Sequence[int]):
        self.noise, self.seed, self.steps = noise, seed, [int(s) for s in steps]
        self._fn: Callable[..., dict[str, jax.Array]] | None = None

    def __call__(self, tr: RunParts, state: TrainState, step: int
                 ) -> dict[str, jax.Array]:
        index = bisect.bisect_left(self.steps, int(step))
        if self._fn is None:
            self._fn = self._build(tr)
        if tr.in_memory:
            return self._fn(state, tr.train_arrays, jnp.int32(index))
        grad_batch, hess_batch = host_batches(self.noise, tr.dataset, index, seed=self.seed)
        return self._fn(state, grad_batch, hess_batch, jnp.int32(index))

    def _build(self, tr: RunParts) -> Callable[..., dict[str, jax.Array]]:
        noise, seed, rep = self.noise, self.seed, mesh.replicated(tr.mesh)
        full = measure.uses_full_data(noise.examples, tr.dataset.num_train)

        def record(state, stats):
            return {"noise/ema_b_simple": state.noise_ema.b_simple} | {
                f"noise/{k}": v for k, v in stats.items()}

        def from_arrays(state, arrays, index):  # in memory: the group's own gather
            return record(state, sweep_measurement(noise, _loss_at(tr, state), state.params,
                                                   tr.dataset, arrays, index, seed=seed))

        def from_batches(state, grad_batch, hess_batch, index):  # streamed: read on the host
            key = measure.measurement_key(seed, index) if full else None
            return record(state, _measure(noise, _loss_at(tr, state), state.params,
                                          grad_batch, hess_batch, key))

        return jax.jit(from_arrays if tr.in_memory else from_batches, out_shardings=rep)
