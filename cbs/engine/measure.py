"""The noise measurement of every path: one call, `measure(spec, ...)`, on drawn examples.

What is measured and when is a `cbs.engine.noise_spec.NoiseSpec`; the estimator is the
registered method it names (`cbs.stats.noise.register_method`; "sampled" and "full_data" are
`cbs.stats.sampled`'s, where the letters and equations are). The paths (docs/design.md,
"The noise measurement"): a run's `Measurement`; `state_measurement` inside a vmapped sweep
group's evaluation (the same draws of (seed, index) as a run's evaluations); a branch study's
reference checkpoints (`cbs.sweeps.branches`). Records are keyed `noise/<key>` by
`cbs.stats.noise.STAT_KEYS`.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cbs import data
from cbs.data import batching
from cbs.engine import live_noise
from cbs.engine.noise_spec import NoiseSpec
from cbs.engine.state import TrainState
from cbs.engine.step import BatchLayout, TrainStep, jit_step
from cbs.runtime import mesh
from cbs.stats import noise, smoothing

__all__ = [
    "EVAL_KEYS", "Measurement", "all_examples", "at_evaluation", "draw", "evaluation_record",
    "host_draw", "measure", "measurement_batches", "state_measurement",
]

PyTree = Any
RunParts = Any  # a cbs.engine.parts.RunParts (not imported: the parts import this module)
LossFn = Callable[[PyTree, PyTree], jax.Array]
_SEED_OFFSET = 7919  # measurement batches use a stream independent of training's
# What an evaluation records: the unbiased |G|² only (not the raw |ḡ|² of the batch).
EVAL_KEYS = tuple(k for k in noise.STAT_KEYS if k != "mean_grad_sq_norm")
# What the measured EMA reports (`noise/measured_ema_<key>`): the unbiased statistics.
EMA_SIMPLE_KEYS = tuple(k for k in noise.SIMPLE_KEYS if not k.startswith("mean_"))
EMA_CURVATURE_KEYS = tuple(k for k in noise.CURVATURE_KEYS if not k.startswith("mean_"))


def measure(spec: NoiseSpec, loss_fn: LossFn, params: PyTree, batch: PyTree, *,
            hessian_batch: PyTree | None = None, key: jax.Array | None = None,
            examples: str | None = None, whole: noise.NoiseStats | None = None
            ) -> noise.NoiseStats:
    """One measurement by the method `spec` names: its `NoiseStats` (jittable).

    Args:
      loss_fn: loss_fn(params, batch) -> mean loss.
      batch: 𝓑, the measured examples (the step's first n, a stream's n, or all N).
      hessian_batch: 𝓒, examples for H drawn independently of 𝓑 (a stream's, or all N);
        None on the step's examples, where with curvature a method that takes a Hessian batch
        gets the deviations from the first half of 𝓑 and H from the second (E[Ĥ] = H given
        the first half when the halves are independent draws); the other statistics use the
        whole batch, or are `whole` (the step's exact live statistics: no extra pass).
      key: PRNG key of the method's random draws (probes; the deviations of "full_data").
      examples: which examples 𝓑 is ("step" | "stream" | "all"; default the spec's).
    """
    examples = examples or spec.examples
    method = spec.resolved_method(examples)
    fn, takes = noise.get_method(method), noise.method_arguments(method)
    kw: dict[str, Any] = dict(key=key, curvature=spec.curvature, num_probes=spec.num_probes,
                              chunk_size=spec.chunk_size or None)
    kw |= {k: v for k, v in (("deviations", spec.deviations),
                             ("hessian_examples", spec.hessian_batch_size)) if k in takes}
    split_hessian = spec.curvature and "hessian_batch" in takes
    if examples != "step" or not split_hessian:
        if split_hessian and hessian_batch is not None:
            kw["hessian_batch"] = hessian_batch
        return fn(loss_fn, params, batch, **kw)
    n = jax.tree.leaves(batch)[0].shape[0]
    if n < 4:
        raise ValueError(f"a curvature measurement needs >= 4 measured examples (two halves "
                         f"of >= 2), got {n}: raise config.noise.batch_size")
    if whole is None:
        whole = fn(loss_fn, params, batch, **(kw | {"curvature": False}))
    half = n // 2
    split = fn(loss_fn, params, jax.tree.map(lambda x: x[:half], batch),
               hessian_batch=jax.tree.map(lambda x: x[half:], batch), **kw)
    return dataclasses.replace(whole, **{k: getattr(split, k) for k in noise.CURVATURE_KEYS})


def evaluation_record(stats: noise.NoiseStats) -> dict[str, jax.Array]:
    """The statistics an evaluation records (keys `EVAL_KEYS`, without the `noise/` prefix)."""
    return {k: jnp.asarray(getattr(stats, k), jnp.float32) for k in EVAL_KEYS
            if getattr(stats, k) is not None}


def _measurement_key(seed: int, index: Any) -> jax.Array:
    """The key of the `index`-th measurement's random draws (𝓒, or the deviations of "all")."""
    return jax.random.fold_in(jax.random.key(seed + _SEED_OFFSET), index)


def measurement_batches(dataset: data.Dataset, arrays: dict[str, jax.Array], index: Any, *,
                        seed: int, batch_size: int, hessian_batch_size: int = 0
                        ) -> tuple[PyTree, PyTree | None]:
    """(𝓑, 𝓒) of the `index`-th measurement on a stream (jittable in `index`). 𝓑: positions
    [index·n, (index + 1)·n) of a training stream independent of training's; 𝓒: h examples
    drawn uniformly without replacement, independently of 𝓑 (None when h = 0)."""
    num = dataset.num_train
    n = min(int(batch_size), num)
    grad_batch = batching.device_batch(dataset, arrays, index * n, n, seed=seed + _SEED_OFFSET)
    if not hessian_batch_size:
        return grad_batch, None
    h = min(int(hessian_batch_size), num)
    idx_h = jax.random.choice(_measurement_key(seed, index), num, (h,), replace=False)
    return grad_batch, dataset.take(arrays, idx_h.astype(jnp.int32), "train")


def all_examples(spec: NoiseSpec, dataset: data.Dataset, arrays: Any, key: jax.Array
                 ) -> tuple[PyTree, PyTree | None]:
    """(𝓑, 𝓒) of a whole-training-set measurement: "full_data", all N in order and 𝓒 None;
    another method, all N in the random order of `key` (its first m a uniform draw of
    deviations) and 𝓒 the same (H over all N)."""
    num = dataset.num_train
    if spec.resolved_method("all") == "full_data":
        return dataset.take(arrays, jnp.arange(num, dtype=jnp.int32)), None
    perm = jax.random.permutation(key, num).astype(jnp.int32)
    everything = dataset.take(arrays, perm, "train")
    return everything, everything


def draw(spec: NoiseSpec, dataset: data.Dataset, arrays: Any, index: Any, *, seed: int
         ) -> tuple[str, PyTree, PyTree | None, jax.Array | None]:
    """(examples, 𝓑, 𝓒, key) of the `index`-th evaluation's measurement of a trial seeded
    `seed` (jittable in `index`), from the training split's stored arrays."""
    examples = spec.examples_for(dataset.num_train)
    if examples == "all":
        key = _measurement_key(seed, index)
        return (examples, *all_examples(spec, dataset, arrays, key), key)
    return (examples, *measurement_batches(
        dataset, arrays, index, seed=seed, batch_size=spec.batch_size,
        hessian_batch_size=spec.hessian_batch_size if spec.curvature else 0), None)


def host_draw(spec: NoiseSpec, dataset: data.Dataset, index: int, *, seed: int
              ) -> tuple[PyTree, PyTree | None]:
    """(𝓑, 𝓒) of `draw`, read on the host from a streamed training split."""
    train = dataset.split("train")
    num = dataset.num_train
    if spec.examples_for(num) == "all":
        key = _measurement_key(seed, index)
        if spec.resolved_method("all") == "full_data":
            return train.read(np.arange(num)), None
        everything = train.read(np.asarray(jax.random.permutation(key, num)))
        return everything, everything
    n = min(spec.batch_size, num)
    grad_batch = batching.host_batch(dataset, index * n, n, seed=seed + _SEED_OFFSET)
    h = min(spec.hessian_batch_size if spec.curvature else 0, num)
    if not h:
        return grad_batch, None
    idx_h = np.asarray(jax.random.choice(_measurement_key(seed, index), num, (h,),
                                         replace=False)).astype(np.int32)
    return grad_batch, train.read(idx_h)


def at_evaluation(spec: NoiseSpec, loss_fn: LossFn, params: PyTree, dataset: data.Dataset,
                  arrays: Any, index: Any, *, seed: int) -> dict[str, jax.Array]:
    """The statistics recorded at the `index`-th evaluation (`draw`, then `measure`)."""
    examples, grad_batch, hess_batch, key = draw(spec, dataset, arrays, index, seed=seed)
    return evaluation_record(measure(spec, loss_fn, params, grad_batch,
                                     hessian_batch=hess_batch, key=key, examples=examples))


def _loss_at(tr: RunParts | TrainStep, state: TrainState) -> LossFn:
    """loss_fn(params, batch) -> mean loss, with the state's model state (BatchNorm etc.)."""
    return lambda p, b: tr.loss_fn(p, state.model_state, b)[0]


def state_measurement(spec: NoiseSpec, tr: RunParts, *, seed: int
                      ) -> Callable[[TrainState, jax.Array], dict[str, jax.Array]]:
    """fn(state, index) -> `at_evaluation` at the state's parameters on the parts'
    device-resident training arrays (jittable and vmappable over states)."""
    return lambda state, index: at_evaluation(spec, _loss_at(tr, state), state.params,
                                              tr.dataset, tr.train_arrays, index, seed=seed)


class Measurement:
    """A run's noise measurement (docs/design.md, "One event"): `step` runs the train step,
    measuring every `spec.every` steps; `evaluation` measures at an evaluation.

    A due step reads the step's exact live statistics when they are the measurement
    (`_serves`: the step then always runs with the reading, NaN between due steps), else runs
    the spec's method on the step's first max(1, n/M) micro-batches in a step variant
    (`in_step`) or in a jit of its own before the step. An evaluation draws at its index on
    the grid `eval_steps` (a final evaluation between grid points gets the next index), or
    at index `step` without a grid. `parts`: the run's `cbs.engine.parts.RunParts`.
    """

    def __init__(self, spec: NoiseSpec, train_step: TrainStep, *, seed: int,
                 parts: RunParts | None = None, eval_steps: Sequence[int] = ()):
        self.spec, self.train_step, self.parts, self.seed = spec, train_step, parts, seed
        self.eval_steps = [int(s) for s in eval_steps]
        ts = train_step
        self.batch_size = spec.batch_size or ts.layout.micro_batch * ts.layout.replicas
        self._plain = jit_step(ts, self._read_live) if self._may_serve() else ts
        self._with_step = jit_step(ts, self._measure_hook) if spec.in_step else None
        lay = ts.layout
        self._alone = jax.jit(self._measure_alone, static_argnums=(2,),
                              in_shardings=(lay.state_sharding, lay.inputs_sharding),
                              out_shardings=(lay.state_sharding.measure_ema,
                                             mesh.replicated(lay.mesh)))
        self._eval_fn: Callable[..., dict[str, jax.Array]] | None = None

    # ------------------------------------------------------------------ every k steps

    def due(self, step: int) -> bool:
        """Whether step `step` measures the step's examples."""
        return bool(self.spec.every) and step % self.spec.every == 0

    def step(self, state: TrainState, inputs: Any, accum_steps: int, step: int
             ) -> tuple[TrainState, tuple[Any, dict[str, jax.Array] | None]]:
        """Step `step` of the run, measuring when due: (state, (step metrics, measured
        metrics or None)), all on the device."""
        if not self.due(step) or self._serves(state, inputs, accum_steps):
            state, metrics = self._plain(state, inputs, accum_steps)
            return state, (metrics, None)
        if self._with_step is not None:
            state, metrics = self._with_step(state, inputs, accum_steps)
            return state, (metrics, None)
        ema, measured = self._alone(state, inputs, accum_steps)
        state, metrics = self._plain(state.replace(measure_ema=ema), inputs, accum_steps)
        return state, (metrics, measured)

    def fields(self, step: int, values: Any) -> dict[str, float]:
        """The record fields of step `step` from its fetched values: the step's metrics, and
        the measurement's on due steps (with `noise/batch_size`, the examples measured)."""
        metrics, measured = values
        rec = {k: float(v) for k, v in metrics.items()}
        if not self.due(step):  # the live reading's NaN between due steps: left out
            return {k: v for k, v in rec.items()
                    if not k.startswith("noise/measured_ema_") and k not in _MEASURED_KEYS}
        rec |= {k: float(v) for k, v in (measured or {}).items()}
        rec["noise/batch_size"] = int(rec.get("noise/batch_size", self.batch_size))
        return rec

    def num_compilations(self) -> int:
        """Compiled variants of the step so far (one per accumulation count and variant)."""
        fns: dict[int, Any] = {id(f): f for f in (self._plain, self._with_step) if f is not None}
        return sum(f.num_compilations() if isinstance(f, TrainStep) else f._cache_size()
                   for f in fns.values())  # a TrainStep, or a jitted variant

    def _may_serve(self) -> bool:
        s = self.spec
        return bool(s.every) and not s.curvature and s.method in live_noise.EXACT_MEASURE_METHODS

    def _serves(self, state: TrainState, inputs: Any, accum_steps: int) -> bool:
        return self._may_serve() and self.train_step.live_kind(state, inputs,
                                                               accum_steps) == "exact"

    def _read_live(self, state: TrainState, chunks: Any, per_micro: int,
                   exact: noise.NoiseStats | None):
        """The step hook of a run the live statistics serve: their reading when due."""
        if exact is None:
            return state.measure_ema, {}
        due = state.step % self.spec.every == 0  # else NaN and the EMA unchanged
        new, out = _measured(state.measure_ema, exact, curvature=False)
        out["noise/batch_size"] = exact.batch_size
        ema = jax.tree.map(lambda n, o: jnp.where(due, n, o), new, state.measure_ema)
        nan = jnp.full((), jnp.nan, jnp.float32)
        return ema, {k: jnp.where(due, jnp.asarray(v, jnp.float32), nan) for k, v in out.items()}

    def _measure_hook(self, state: TrainState, chunks: Any, per_micro: int,
                      exact: noise.NoiseStats | None):
        """The step hook of a due step: `_step_measurement` (class docstring)."""
        spec, ts = self.spec, self.train_step
        whole = exact if spec.method in live_noise.EXACT_MEASURE_METHODS else None
        return _step_measurement(spec, _loss_at(ts, state), state, chunks, per_micro,
                                 ts.layout, seed=self.seed, whole=whole)

    def _measure_alone(self, state: TrainState, inputs: Any, accum_steps: int):
        """The measurement of a due step without its update (jitted as `_alone`): the step
        with the hook, of which only the measurement is kept (the rest is never computed)."""
        out: list = []

        def hook(st, chunks, per_micro, exact):
            out.append(self._measure_hook(st, chunks, per_micro, None))
            return out[0]

        self.train_step.apply(state, inputs, accum_steps, hook)
        return out[0]

    # ------------------------------------------------------------------ evaluations

    def evaluation(self, state: TrainState, step: int) -> dict[str, jax.Array]:
        """{"noise/ema_b_simple", "noise/<key>" of `at_evaluation`} after `step` updates
        (device values), or {} when the spec does not measure at evaluations."""
        if not self.spec.measures_at_evals:
            return {}
        tr = self.parts
        assert tr is not None, "a Measurement that measures at evaluations needs its parts"
        steps = self.eval_steps
        index = bisect.bisect_left(steps, int(step)) if steps else int(step)
        if self._eval_fn is None:
            self._eval_fn = self._build_evaluation()
        inputs = ((tr.train_arrays,) if tr.in_memory else  # streamed: 𝓑, 𝓒 read on the host
                  host_draw(self.spec, tr.dataset, index, seed=self.seed))
        return self._eval_fn(state, *inputs, jnp.int32(index))

    def _build_evaluation(self) -> Callable[..., dict[str, jax.Array]]:
        spec, seed, tr = self.spec, self.seed, self.parts
        assert tr is not None
        examples = spec.examples_for(tr.dataset.num_train)

        def record(state, stats):
            return {"noise/ema_b_simple": state.noise_ema.b_simple} | {
                f"noise/{k}": v for k, v in stats.items()}

        def from_arrays(state, arrays, index):  # in memory: the group's own gather
            return record(state, at_evaluation(spec, _loss_at(tr, state), state.params,
                                               tr.dataset, arrays, index, seed=seed))

        def from_batches(state, grad_batch, hess_batch, index):  # streamed: read on the host
            key = _measurement_key(seed, index) if examples == "all" else None
            stats = measure(spec, _loss_at(tr, state), state.params, grad_batch,
                            hessian_batch=hess_batch, key=key, examples=examples)
            return record(state, evaluation_record(stats))

        return jax.jit(from_arrays if tr.in_memory else from_batches,
                       out_shardings=mesh.replicated(tr.mesh))


def _step_measurement(spec: NoiseSpec, loss_fn: LossFn, state: TrainState, chunks: PyTree,
                      per_micro: int, layout: BatchLayout, *, seed: int,
                      whole: noise.NoiseStats | None = None
                      ) -> tuple[smoothing.NoiseScaleEMA, dict[str, jax.Array]]:
    """(updated measure_ema, noise/* metrics) of the train step's measurement: `measure` on
    its first max(1, n/M) micro-batches of M = R·m examples (the first n·C/A of its `chunks`
    [C, B/C, ...], `per_micro` = C/A chunks each), the method's random draws keyed by (seed,
    step)."""
    n_micro = max(1, spec.batch_size // (layout.micro_batch * layout.replicas))
    n_micro = min(n_micro, jax.tree.leaves(chunks)[0].shape[0] // per_micro)
    batch = jax.tree.map(lambda x: x[:n_micro * per_micro].reshape(-1, *x.shape[2:]), chunks)
    key = jax.random.fold_in(jax.random.key(seed), state.step)
    stats = measure(spec, loss_fn, state.params, batch, key=key, examples="step", whole=whole)
    if spec.curvature and stats.trace_h_sigma is None:
        raise ValueError(f"noise method {spec.method!r} returned no curvature statistics "
                         "(trace_h_sigma, g_h_g) though curvature was asked for")
    ema, out = _measured(state.measure_ema, stats, curvature=spec.curvature)
    return ema, {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}


def _measured(ema: smoothing.NoiseScaleEMA, stats: noise.NoiseStats, *, curvature: bool
              ) -> tuple[smoothing.NoiseScaleEMA, dict[str, Any]]:
    """(`ema` updated with a measurement, the measurement's noise/* metrics with the EMA's)."""
    curv = dict(trace_h_sigma=stats.trace_h_sigma, g_h_g=stats.g_h_g) if curvature else {}
    ema = ema.update(stats.grad_sq_norm, stats.trace_sigma, **curv)
    names = EMA_SIMPLE_KEYS + (EMA_CURVATURE_KEYS if curvature else ())
    return ema, stats.to_dict("noise/") | {f"noise/measured_ema_{n}": getattr(ema, n)
                                           for n in names}


# the keys of a measurement in a train record (left out between due steps)
_MEASURED_KEYS = frozenset(f"noise/{k}" for k in (*noise.STAT_KEYS, "batch_size"))
