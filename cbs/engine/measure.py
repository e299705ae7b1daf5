"""The noise measurement of every path: one call, `measure(spec, ...)`, on drawn examples.

What is measured and when is a `cbs.engine.noise_spec.NoiseSpec` (from `config.noise`); the
estimator is the registered method it names (`cbs.stats.noise.register_method`: "auto",
"fast", "vmap", "probe", and "sampled" and "full_data" of `cbs.stats.sampled`, where the
letters and equations are). The paths, all through `measure`:

- the train step every k steps, on its own batch (`step_measurement`, called under the step's
  jit or in `cbs.engine.step.TrainStep.measure_now`);
- each evaluation, on examples of their own (`draw`: 𝓑 at stream positions that depend only
  on (seed, evaluation index), 𝓒 an independent draw; or the whole training set):
  `state_measurement` inside a vmapped sweep group's evaluation, `EvalMeasurement` as the
  `on_eval` hook of an engine run (a sweep's engine trial, or a single run whose
  `noise.examples` is not "step"), both recording `evaluation_record`; the same (seed,
  index) gives the same draws, so both back ends record the same numbers;
- a sweep's reference run (a vmapped group of one, the "full_data" method) and a branch
  study's reference checkpoints (`cbs.sweeps.branches`: "sampled" on the whole training set
  in a random order, its first m the deviations and H over all N).

Records are keyed `noise/<key>` by the one list `cbs.stats.noise.STAT_KEYS`.
"""

from __future__ import annotations

import bisect
import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cbs import data
from cbs.data import batching
from cbs.engine import live_noise, mesh
from cbs.engine.noise_spec import NoiseSpec
from cbs.stats import noise, smoothing

__all__ = [
    "EVAL_KEYS", "EvalMeasurement", "SEED_OFFSET", "all_examples", "at_evaluation", "draw",
    "evaluation_record", "host_draw", "in_step_measurement", "measure", "measurement_batches",
    "measurement_key", "serves", "state_measurement", "step_measurement",
]

PyTree = Any
RunParts = Any  # a cbs.engine.parts.RunParts (not imported: the parts import this module)
TrainState = Any  # a cbs.engine.step.TrainState (likewise)
LossFn = Callable[[PyTree, PyTree], jax.Array]
SEED_OFFSET = 7919  # measurement batches use a stream independent of training's
# What an evaluation records: the unbiased |G|² only (not the raw |ḡ|² of the batch).
EVAL_KEYS = tuple(k for k in noise.STAT_KEYS if k != "mean_grad_sq_norm")
# What the measured EMA reports (`noise/measured_ema_<key>`): the unbiased statistics.
EMA_SIMPLE_KEYS = tuple(k for k in noise.SIMPLE_KEYS if not k.startswith("mean_"))
EMA_CURVATURE_KEYS = tuple(k for k in noise.CURVATURE_KEYS if not k.startswith("mean_"))


def measure(spec: NoiseSpec, loss_fn: LossFn, params: PyTree, batch: PyTree, *,
            hessian_batch: PyTree | None = None, key: jax.Array | None = None,
            examples: str | None = None, whole: noise.NoiseStats | None = None
            ) -> noise.NoiseStats:
    """One measurement by the method `spec` names, on drawn examples (jittable).

    Args:
      loss_fn: loss_fn(params, batch) -> mean loss.
      batch: 𝓑, the measured examples (the step's first n, a stream's n, or all N).
      hessian_batch: 𝓒, examples for H drawn independently of 𝓑 (a stream's, or all N);
        None on the step's examples, where with curvature a method that takes a Hessian batch
        gets the deviations from the first half of 𝓑 and H from the second (E[Ĥ] = H given
        the first half when the halves are independent draws), while trace_sigma,
        grad_sq_norm and b_simple use the whole batch, or are `whole` when given (the exact
        live statistics of the step's batch: no extra pass).
      key: PRNG key of the method's random draws (probes; the deviations of "full_data").
      examples: which examples 𝓑 is ("step" | "stream" | "all"; default the spec's).
    Returns:
      the method's `NoiseStats`.
    """
    examples = examples or spec.examples
    fn = noise.get_method(spec.resolved_method(examples))
    kw: dict[str, Any] = dict(key=key, curvature=spec.curvature, num_probes=spec.num_probes,
                              chunk_size=spec.chunk_size or None)
    takes = inspect.signature(fn).parameters
    if "deviations" in takes:
        kw["deviations"] = spec.deviations
    if "hessian_examples" in takes:
        kw["hessian_examples"] = spec.hessian_batch_size
    if examples != "step" or not (spec.curvature and noise.takes_hessian_batch(fn)):
        if spec.curvature and hessian_batch is not None and noise.takes_hessian_batch(fn):
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


def step_measurement(spec: NoiseSpec, loss_fn: LossFn, state: TrainState, chunks: PyTree,
                     per_micro: int, micro_examples: int, *, seed: int,
                     whole: noise.NoiseStats | None = None
                     ) -> tuple[smoothing.NoiseScaleEMA, dict[str, jax.Array]]:
    """(updated measure_ema, noise/* metrics) of the train step's measurement: `measure` on
    its first max(1, n/M) micro-batches of M = `micro_examples` examples (the first
    n·C/A of its `chunks` [C, B/C, ...], `per_micro` = C/A chunks each), the method's random
    draws keyed by (seed, step)."""
    n_micro = max(1, spec.batch_size // micro_examples)
    n_micro = min(n_micro, jax.tree.leaves(chunks)[0].shape[0] // per_micro)
    batch = jax.tree.map(lambda x: x[:n_micro * per_micro].reshape(-1, *x.shape[2:]), chunks)
    key = jax.random.fold_in(jax.random.key(seed), state.step)
    stats = measure(spec, loss_fn, state.params, batch, key=key, examples="step", whole=whole)
    if spec.curvature and stats.trace_h_sigma is None:
        raise ValueError(f"noise method {spec.method!r} returned no curvature statistics "
                         "(trace_h_sigma, g_h_g) though curvature was asked for")
    curv = dict(trace_h_sigma=stats.trace_h_sigma, g_h_g=stats.g_h_g) if spec.curvature else {}
    ema = state.measure_ema.update(stats.grad_sq_norm, stats.trace_sigma, **curv)
    names = EMA_SIMPLE_KEYS + (EMA_CURVATURE_KEYS if spec.curvature else ())
    out = stats.to_dict("noise/") | {f"noise/measured_ema_{n}": getattr(ema, n)
                                     for n in names}
    return ema, {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}


def serves(spec: NoiseSpec | None, live_kind: str) -> bool:
    """Whether the step's exact live statistics are its every-k-steps measurement (an exact
    B_simple measurement, no curvature, with an exact live estimate: no extra pass)."""
    return (spec is not None and live_kind == "exact" and not spec.curvature
            and spec.method in live_noise.EXACT_MEASURE_METHODS)


def in_step_measurement(spec: NoiseSpec | None, step: jax.Array,
                        measure_ema: smoothing.NoiseScaleEMA, exact: noise.NoiseStats | None,
                        measure_fn: Callable[[noise.NoiseStats | None], Any], *, served: bool,
                        in_step: bool) -> tuple[smoothing.NoiseScaleEMA, dict[str, jax.Array]]:
    """(measure_ema, noise/* metrics) of the step's measurement inside the step: when due
    (step % every == 0), the exact live statistics `exact` of the step's batch when they
    serve it (`serves`), else `measure_fn(whole)` under `lax.cond` (`in_step`); NaN metrics
    and the EMA unchanged when not due; nothing without a measurement in the step."""
    if spec is None:
        return measure_ema, {}
    due = step % spec.every == 0
    if served and exact is not None:
        return live_noise.measurement(measure_ema, due, exact)
    if not in_step:
        return measure_ema, {}
    whole = exact if spec.method in live_noise.EXACT_MEASURE_METHODS else None
    run = lambda: measure_fn(whole)
    skipped = lambda: (measure_ema, jax.tree.map(
        lambda s: jnp.full(s.shape, jnp.nan, s.dtype), jax.eval_shape(run)[1]))
    return jax.lax.cond(due, run, skipped)


def evaluation_record(stats: noise.NoiseStats) -> dict[str, jax.Array]:
    """The statistics an evaluation records (keys `EVAL_KEYS`, without the `noise/` prefix)."""
    return {k: jnp.asarray(getattr(stats, k), jnp.float32) for k in EVAL_KEYS
            if getattr(stats, k) is not None}


def measurement_key(seed: int, index: Any) -> jax.Array:
    """The key of the `index`-th measurement's random draws (its Hessian batch 𝓒, or the
    deviations of a whole-training-set measurement) for training seed `seed`."""
    return jax.random.fold_in(jax.random.key(seed + SEED_OFFSET), index)


def measurement_batches(dataset: data.Dataset, arrays: dict[str, jax.Array], index: Any, *,
                        seed: int, batch_size: int, hessian_batch_size: int = 0
                        ) -> tuple[PyTree, PyTree | None]:
    """(𝓑, 𝓒) of the `index`-th measurement on a stream (jittable in `index`).

    𝓑: stream positions [index·n, (index + 1)·n) of a training stream seeded `seed +
    SEED_OFFSET` (independent of training's, never reusing a batch within an epoch); 𝓒: h
    examples drawn uniformly without replacement with a key of its own (independent of 𝓑);
    None when hessian_batch_size is 0.
    """
    num = dataset.num_train
    n = min(int(batch_size), num)
    grad_batch = batching.device_batch(dataset, arrays, index * n, n, seed=seed + SEED_OFFSET)
    if not hessian_batch_size:
        return grad_batch, None
    h = min(int(hessian_batch_size), num)
    idx_h = jax.random.choice(measurement_key(seed, index), num, (h,), replace=False)
    return grad_batch, dataset.take(arrays, idx_h.astype(jnp.int32), "train")


def all_examples(spec: NoiseSpec, dataset: data.Dataset, arrays: Any, key: jax.Array
                 ) -> tuple[PyTree, PyTree | None]:
    """(𝓑, 𝓒) of a whole-training-set measurement: all N examples in their order, 𝓒 None
    ("full_data" draws what it needs with `key`); for another method all N in the random
    order of `key` (so that the first m are a uniform draw of deviations) and 𝓒 the same
    examples (H over all N)."""
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
        key = measurement_key(seed, index)
        return (examples, *all_examples(spec, dataset, arrays, key), key)
    grad_batch, hess_batch = measurement_batches(
        dataset, arrays, index, seed=seed, batch_size=spec.batch_size,
        hessian_batch_size=spec.hessian_batch_size if spec.curvature else 0)
    return examples, grad_batch, hess_batch, None


def host_draw(spec: NoiseSpec, dataset: data.Dataset, index: int, *, seed: int
              ) -> tuple[PyTree, PyTree | None]:
    """(𝓑, 𝓒) of `draw` read on the host from a streamed training split (all N with the
    whole training set, in the order `draw` uses)."""
    train = dataset.split("train")
    num = dataset.num_train
    if spec.examples_for(num) == "all":
        key = measurement_key(seed, index)
        if spec.resolved_method("all") == "full_data":
            return train.read(np.arange(num)), None
        everything = train.read(np.asarray(jax.random.permutation(key, num)))
        return everything, everything
    n = min(spec.batch_size, num)
    grad_batch = batching.host_batch(dataset, index * n, n, seed=seed + SEED_OFFSET)
    h = min(spec.hessian_batch_size if spec.curvature else 0, num)
    if not h:
        return grad_batch, None
    idx_h = np.asarray(jax.random.choice(measurement_key(seed, index), num, (h,),
                                         replace=False)).astype(np.int32)
    return grad_batch, train.read(idx_h)


def at_evaluation(spec: NoiseSpec, loss_fn: LossFn, params: PyTree, dataset: data.Dataset,
                  arrays: Any, index: Any, *, seed: int) -> dict[str, jax.Array]:
    """The statistics recorded at the `index`-th evaluation (`draw`, then `measure`;
    jittable). `arrays`: the training split's stored arrays."""
    examples, grad_batch, hess_batch, key = draw(spec, dataset, arrays, index, seed=seed)
    return evaluation_record(measure(spec, loss_fn, params, grad_batch,
                                     hessian_batch=hess_batch, key=key, examples=examples))


def _loss_at(tr: RunParts, state: TrainState) -> LossFn:
    """loss_fn(params, batch) -> mean loss, with the state's model state (BatchNorm etc.)."""
    return lambda p, b: tr.loss_fn(p, state.model_state, b)[0]


def state_measurement(spec: NoiseSpec, tr: RunParts, *, seed: int
                      ) -> Callable[[TrainState, jax.Array], dict[str, jax.Array]]:
    """fn(state, index) -> `at_evaluation` at the state's parameters on the parts'
    device-resident training arrays (jittable and vmappable over states)."""

    def fn(state: TrainState, index: jax.Array) -> dict[str, jax.Array]:
        return at_evaluation(spec, _loss_at(tr, state), state.params, tr.dataset,
                             tr.train_arrays, index, seed=seed)

    return fn


class EvalMeasurement:
    """The `on_eval` hook (`cbs.engine.trainer.run`) that measures at each evaluation:
    {"noise/ema_b_simple", "noise/<key>" of `at_evaluation`} after `step` updates, at the
    evaluation's index on the grid `steps` (a sweep trial's `eval.steps`, the grid of a
    vmapped group; a final evaluation between grid points gets the next index), or at index
    `step` without a grid."""

    def __init__(self, spec: NoiseSpec, *, seed: int, steps: Sequence[int] = ()):
        self.spec, self.seed, self.steps = spec, seed, [int(s) for s in steps]
        self._fn: Callable[..., dict[str, jax.Array]] | None = None

    def __call__(self, tr: RunParts, state: TrainState, step: int) -> dict[str, jax.Array]:
        index = bisect.bisect_left(self.steps, int(step)) if self.steps else int(step)
        if self._fn is None:
            self._fn = self._build(tr)
        if tr.in_memory:
            return self._fn(state, tr.train_arrays, jnp.int32(index))
        grad_batch, hess_batch = host_draw(self.spec, tr.dataset, index, seed=self.seed)
        return self._fn(state, grad_batch, hess_batch, jnp.int32(index))

    def _build(self, tr: RunParts) -> Callable[..., dict[str, jax.Array]]:
        spec, seed = self.spec, self.seed
        examples = spec.examples_for(tr.dataset.num_train)

        def record(state, stats):
            return {"noise/ema_b_simple": state.noise_ema.b_simple} | {
                f"noise/{k}": v for k, v in stats.items()}

        def from_arrays(state, arrays, index):  # in memory: the group's own gather
            return record(state, at_evaluation(spec, _loss_at(tr, state), state.params,
                                               tr.dataset, arrays, index, seed=seed))

        def from_batches(state, grad_batch, hess_batch, index):  # streamed: read on the host
            key = measurement_key(seed, index) if examples == "all" else None
            stats = measure(spec, _loss_at(tr, state), state.params, grad_batch,
                            hessian_batch=hess_batch, key=key, examples=examples)
            return record(state, evaluation_record(stats))

        return jax.jit(from_arrays if tr.in_memory else from_batches,
                       out_shardings=mesh.replicated(tr.mesh))
