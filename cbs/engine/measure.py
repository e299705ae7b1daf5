"""The noise measurements of a run: the train step's periodic one and a sweep's batches.

`cbs.engine.step` measures every `noise.every` steps on its own training batch through the
registered methods of `cbs.stats.noise` (`Measurement`, `measure_batch`): with curvature the
deviations come from the first half of the batch and H from the second.

A sweep measures each trial at its evaluations on batches of its own (`measurement_batches`:
a stream independent of training's, and an independent Hessian draw), or on the whole
training set (`uses_full_data`), with the estimators of `cbs.stats.sampled` (re-exported
here: `measure_noise`, `measure_full_data`, `resolve_b_noise`; letters and equations there).
`cbs.sweeps.measurement` puts the two together for both sweep back ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cbs import data
from cbs.engine import fields, live_noise
from cbs.stats import noise
from cbs.stats.sampled import (  # noqa: F401 - public: measure.*
    measure_full_data,
    measure_noise,
    resolve_b_noise,
)

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]
SEED_OFFSET = 7919  # measurement batches use a stream independent of training's
NOISE_EXAMPLES = ("sampled", "all", "auto")  # values of sweep.noise_examples
FULL_DATA_MAX = 10_000  # "auto": the whole training set when N <= this many examples


def validate_config(noise_config: Any) -> None:
    """Checks `config.noise`, the settings of a run's noise measurements: the in-step two-batch
    estimate (small_batch, ema_decay) and the periodic measurement (every, method, batch_size,
    num_probes, chunk_size) of `cbs.engine.step`. Raises `fields.ConfigError` naming the first
    bad field; sizes against the batch and the mesh are `cbs.engine.config.validate`'s."""
    at = "config.noise"
    fields.integer(noise_config, "small_batch", at, minimum=0)
    decay = fields.number(noise_config, "ema_decay", at)
    if not decay < 1:
        raise fields.ConfigError(f"{at}.ema_decay: must be < 1, got {noise_config.ema_decay}")
    fields.integer(noise_config, "every", at, minimum=0)
    fields.choice(noise_config, "method", at, noise.method_names())
    fields.integer(noise_config, "batch_size", at, minimum=0)
    fields.integer(noise_config, "num_probes", at)
    fields.integer(noise_config, "chunk_size", at, minimum=0)
    if "live" in noise_config:
        fields.choice(noise_config, "live", at, live_noise.LIVE_METHODS)


class Measurement(NamedTuple):
    """What to measure every `every` steps, on the first `micro_batches` micro-batches.

    An exact B_simple measurement (method "auto" | "fast" | "vmap", no curvature) in a step
    whose live estimate is exact is that estimate on the step's whole batch: no extra pass,
    `micro_batches` and `in_step` unused (`cbs.engine.step.TrainStep.measured_in_step`).
    With curvature in the step (`in_step`), its B_simple fields are those live statistics
    too, and only the curvature pass runs on the first micro-batches.
    """

    method: str = "auto"  # a cbs.stats.noise method: "auto" | "fast" | "vmap" (exact) |
    #                       "probe" | "sampled"
    every: int = 100  # steps between measurements
    micro_batches: int = 1  # how many micro-batches (of M = R·m examples) are measured
    curvature: bool = False  # also tr(HΣ), GᵀHG, b_noise
    num_probes: int = 1  # probe vectors ("probe")
    chunk_size: int = 0  # examples per vmap chunk in exact (0: all at once)
    in_step: bool = False  # under lax.cond in the step (True) or by `measure_now` (False)


def measure_batch(fn: noise.MethodFn, loss_fn, params, batch, *, curvature: bool,
                  whole: noise.NoiseStats | None = None, **kw) -> noise.NoiseStats:
    """A train step's every-k-steps measurement by the method `fn`. With curvature and a
    method that takes `hessian_batch`, the curvature terms are unbiased: deviations and ḡ
    from the first half of the batch, H from the second (E[Ĥ] = H given the first half when
    the halves are independent draws; without replacement from N examples each example's own
    Hessian enters its term with weight −1/(N − n/2) instead of the same-batch estimator's
    +1/(n/2)), while trace_sigma, grad_sq_norm and b_simple use the whole batch, or are
    `whole` when given (the exact live statistics of the train step's batch: no extra pass)."""
    n = jax.tree.leaves(batch)[0].shape[0]
    if not (curvature and noise.takes_hessian_batch(fn)):
        return fn(loss_fn, params, batch, curvature=curvature, **kw)
    if n < 4:
        raise ValueError(f"a curvature measurement needs >= 4 measured examples (two halves "
                         f"of >= 2), got {n}: raise config.noise.batch_size")
    if whole is None:
        whole = fn(loss_fn, params, batch, curvature=False, **kw)
    half = n // 2
    split = fn(loss_fn, params, jax.tree.map(lambda x: x[:half], batch), curvature=True,
               hessian_batch=jax.tree.map(lambda x: x[half:], batch), **kw)
    return dataclasses.replace(whole, **{k: getattr(split, k) for k in noise.CURVATURE_KEYS})


def uses_full_data(noise_examples: str, num_train: int) -> bool:
    """Whether a sweep measures on the whole training set (`sweep.noise_examples`: "all";
    "auto" when num_train <= FULL_DATA_MAX; "sampled": never)."""
    if noise_examples not in NOISE_EXAMPLES:
        raise ValueError(f"sweep.noise_examples must be one of {NOISE_EXAMPLES}, got "
                         f"{noise_examples!r}")
    return noise_examples == "all" or (noise_examples == "auto" and num_train <= FULL_DATA_MAX)


def measurement_key(seed: int, index: Any) -> jax.Array:
    """The key of the `index`-th measurement's random draws (its Hessian batch 𝓒, or the
    deviations of a whole-training-set measurement) for training seed `seed`."""
    return jax.random.fold_in(jax.random.key(seed + SEED_OFFSET), index)


def measurement_batches(dataset: data.Dataset, arrays: dict[str, jax.Array], index: Any, *,
                        seed: int, batch_size: int, hessian_batch_size: int = 0
                        ) -> tuple[PyTree, PyTree | None]:
    """(𝓑, 𝓒) of the `index`-th measurement (jittable in `index`).

    𝓑: stream positions [index·n, (index + 1)·n) of a training stream seeded `seed +
    SEED_OFFSET` (independent of training's, never reusing a batch within an epoch); 𝓒: h
    examples drawn uniformly without replacement with a key of its own (independent of 𝓑);
    None when hessian_batch_size is 0.
    """
    num = dataset.num_train
    n = min(int(batch_size), num)
    grad_batch = data.device_batch(dataset, arrays, index * n, n, seed=seed + SEED_OFFSET)
    if not hessian_batch_size:
        return grad_batch, None
    h = min(int(hessian_batch_size), num)
    idx_h = jax.random.choice(measurement_key(seed, index), num, (h,), replace=False)
    return grad_batch, dataset.take(arrays, idx_h.astype(jnp.int32), "train")
