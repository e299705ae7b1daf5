"""The periodic noise measurement of a run, with B_noise unbiased by construction.

Letters: N training examples (the population: G, H and Σ are over them), 𝓑 the measured
batch (n examples: gradients), 𝓐 ⊆ 𝓑 its first m examples (deviations), 𝓒 an independent
draw of h examples (the Hessian Ĥ = ∇²L_𝓒), g_i per-example gradients, ḡ_𝓑 and ḡ_𝓐 means.

    trace_sigma, grad_sq_norm, b_simple      cbs.stats.noise.exact on 𝓑
    trace_h_sigma = Σ_{i∈𝓐} (g_i − ḡ_𝓐)ᵀ Ĥ (g_i − ḡ_𝓐) / (m − 1)
    mean_g_h_g    = ḡ_𝓑ᵀ Ĥ ḡ_𝓑
    g_h_g         = mean_g_h_g − trace_h_sigma / n
    b_noise       = trace_h_sigma / g_h_g

Why a separate 𝓒: `noise.exact(curvature=True)` on one batch takes H from the same examples
whose deviations it measures, so each example's own Hessian enters its term (d_iᵀH_i d_i / m):
with m = 32 on the digits MLP that inflated tr(HΣ) about threefold and drove g_h_g negative.
Here 𝓒 is drawn independently of 𝓑, so E[Ĥ | 𝓑] = H and every term is linear in Ĥ: for
𝓑 a uniform draw without replacement, E[trace_h_sigma] = Σ_i d_iᵀHd_i / (N − 1) and
E[g_h_g] = GᵀHG − E[trace_h_sigma]/N, which is what `noise.exact(curvature=True)` gives on
all N examples. Cost: m per-example gradients and m + 1 HVPs on h examples.
Residual biases of this sampled estimator: E[g_h_g] = GᵀHG − E[trace_h_sigma]/N and
E[grad_sq_norm] = |G|² − E[trace_sigma]/N under without-replacement draws (relative size
1/(N·B_noise), 1/(N·B_simple)), and a reported B at a crossing is a ratio of window means
(each unbiased, their ratio biased by O(variance/mean²) of the window mean).

Full training set (`measure_full_data`, for small N): G, |G|², tr(Σ) and GᵀHG exactly over
all N (H = ∇²L over all N), and tr(HΣ) from the deviations d_i = g_i − G of a uniform subset 𝓐
of m examples drawn without replacement:

    trace_sigma   = Σ_{i≤N} |g_i − G|² / (N − 1)
    grad_sq_norm  = mean_grad_sq_norm = |G|²
    g_h_g         = mean_g_h_g = GᵀHG
    trace_h_sigma = N/(N − 1) · (1/m) Σ_{i∈𝓐} d_iᵀ H d_i
    b_simple = trace_sigma / grad_sq_norm,   b_noise = trace_h_sigma / g_h_g

Every term is exact but trace_h_sigma, which is exactly unbiased for Σ_{i≤N} d_iᵀHd_i/(N − 1)
(H and G are fixed: no example's own Hessian is over-weighted). Cost: one pass over N for the
per-example norms and m + 1 HVPs over N (all N would be O(N²)); optionally the m HVPs of
trace_h_sigma use the Hessian of h examples drawn independently of 𝓐 (still unbiased).

In-step measurements (single runs, the adaptive ramp on b_noise) see only their training
batch: `cbs.engine.step` takes the deviations from its first half and H from its second.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cbs import data
from cbs.engine import fields, live_noise
from cbs.stats import curvature, noise, trees

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]
SEED_OFFSET = 7919  # measurement batches use a stream independent of training's
CURVATURE_KEYS = ("trace_h_sigma", "mean_g_h_g", "g_h_g", "b_noise")
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

    method: str = "auto"  # a cbs.stats.noise method: "auto" | "fast" | "vmap" (exact) | "probe"
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


def measure_noise(loss_fn: LossFn, params: PyTree, grad_batch: PyTree,
                  hess_batch: PyTree | None = None, *, deviations: int = 0,
                  chunk_size: int | None = None) -> dict[str, jax.Array]:
    """Noise statistics at `params` (float32 scalars, keys without prefix).

    Args:
      loss_fn: loss_fn(params, batch) -> mean loss.
      grad_batch: 𝓑, n examples: trace_sigma, grad_sq_norm, b_simple, and ḡ_𝓑.
      hess_batch: 𝓒, examples drawn independently of 𝓑 for the Hessian; None: no curvature.
      deviations: m, the first m examples of 𝓑 whose deviations give trace_h_sigma
        (2 ≤ m ≤ n; 0 = all n).
      chunk_size: examples per vmap chunk (memory).
    Returns:
      {"trace_sigma", "grad_sq_norm", "mean_grad_sq_norm", "b_simple"} and, with hess_batch,
      {"trace_h_sigma", "mean_g_h_g", "g_h_g", "b_noise"} (module docstring).
    """
    stats = noise.exact(loss_fn, params, grad_batch, chunk_size=chunk_size)
    out = {k: getattr(stats, k) for k in ("trace_sigma", "grad_sq_norm", "mean_grad_sq_norm",
                                          "b_simple")}
    if hess_batch is not None:
        out |= _curvature(loss_fn, params, grad_batch, hess_batch, deviations, chunk_size)
    return {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}


def _curvature(loss_fn, params, grad_batch, hess_batch, deviations, chunk_size):
    n = jax.tree.leaves(grad_batch)[0].shape[0]
    m = min(deviations or n, n)
    if m < 2:
        raise ValueError(f"the curvature measurement needs >= 2 deviation examples, got {m}")
    _, hvp = curvature.hvp_fn(loss_fn, params, hess_batch)
    grad_n = jax.grad(loss_fn)(params, grad_batch)
    mean_g_h_g = trees.tree_dot(grad_n, hvp(grad_n))
    batch_m = jax.tree.map(lambda x: x[:m], grad_batch)
    grad_m = jax.grad(loss_fn)(params, batch_m)

    def form(example):
        one = jax.tree.map(lambda x: x[None], example)
        d = jax.tree.map(jnp.subtract, jax.grad(loss_fn)(params, one), grad_m)
        return trees.tree_dot(d, hvp(d))

    forms_m = jax.lax.map(form, batch_m, batch_size=min(chunk_size or m, m))
    trace_h_sigma = jnp.sum(forms_m) / (m - 1)
    g_h_g = mean_g_h_g - trace_h_sigma / n
    return {"trace_h_sigma": trace_h_sigma, "mean_g_h_g": mean_g_h_g, "g_h_g": g_h_g,
            "b_noise": trace_h_sigma / g_h_g}


def measure_full_data(loss_fn: LossFn, params: PyTree, train_batch: PyTree,
                      key: jax.Array | None = None, *, deviations: int = 0,
                      hessian_examples: int = 0, chunk_size: int | None = None
                      ) -> dict[str, jax.Array]:
    """Noise statistics of the whole training set at `params` (module docstring).

    Args:
      loss_fn: loss_fn(params, batch) -> mean loss.
      train_batch: all N training examples (the population: G, Σ and H are theirs).
      key: PRNG key drawing the subset 𝓐 of `deviations` examples (needed when > 0).
      deviations: m, examples whose deviations give trace_h_sigma (0 = no curvature,
        m ≥ N: every example, no sampling).
      hessian_examples: 0 (or ≥ N): trace_h_sigma's H over all N; h > 0: H of h examples
        drawn uniformly without replacement, independently of 𝓐 (E[Ĥ] = H, so still
        unbiased, at h/N of the HVP cost). GᵀHG always uses all N.
      chunk_size: examples per vmap chunk (memory).
    Returns:
      float32 scalars {"trace_sigma", "grad_sq_norm", "mean_grad_sq_norm", "b_simple"} and,
      when deviations > 0, {"trace_h_sigma", "mean_g_h_g", "g_h_g", "b_noise"}.
    """
    num = jax.tree.leaves(train_batch)[0].shape[0]
    stats = noise.exact(loss_fn, params, train_batch, chunk_size=chunk_size)
    grad_sq_norm = stats.mean_grad_sq_norm  # |G|², exact: G is the population gradient
    out = {"trace_sigma": stats.trace_sigma, "grad_sq_norm": grad_sq_norm,
           "mean_grad_sq_norm": grad_sq_norm, "b_simple": stats.trace_sigma / grad_sq_norm}
    if deviations:
        out |= _full_curvature(loss_fn, params, train_batch, key, min(deviations, num),
                               hessian_examples, chunk_size)
    return {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}


def _draw(batch, key, size, num):
    """`size` examples of `batch` drawn uniformly without replacement (all when size ≥ num)."""
    if size >= num:
        return batch
    if key is None:
        raise ValueError("measure_full_data: a key is needed to draw a subset of examples")
    idx = jax.random.choice(key, num, (size,), replace=False)
    return jax.tree.map(lambda x: jnp.take(x, idx, axis=0), batch)


def _full_curvature(loss_fn, params, train_batch, key, m, h, chunk_size):
    num = jax.tree.leaves(train_batch)[0].shape[0]
    if m < 1:
        raise ValueError(f"the curvature measurement needs >= 1 deviation example, got {m}")
    dtype = trees.accum_dtype()
    grad, hvp = curvature.hvp_fn(loss_fn, params, train_batch)
    g_h_g = trees.tree_dot(grad, hvp(grad))
    key_a, key_c = (None, None) if key is None else jax.random.split(key)
    subset = _draw(train_batch, key_a, m, num)
    if h and h < num:
        _, hvp = curvature.hvp_fn(loss_fn, params, _draw(train_batch, key_c, h, num))
    grad_acc = trees.tree_cast(grad, dtype)

    def form(example):
        g = jax.grad(loss_fn)(params, jax.tree.map(lambda x: x[None], example))
        d = trees.tree_sub(trees.tree_cast(g, dtype), grad_acc)
        return trees.tree_dot(d, hvp(d))

    forms = jax.lax.map(form, subset, batch_size=min(chunk_size or m, m))
    trace_h_sigma = jnp.mean(forms) * num / (num - 1)
    return {"trace_h_sigma": trace_h_sigma, "mean_g_h_g": g_h_g, "g_h_g": g_h_g,
            "b_noise": trace_h_sigma / g_h_g}


def uses_full_data(noise_examples: str, num_train: int) -> bool:
    """Whether a sweep measures on the whole training set (`sweep.noise_examples`: "all";
    "auto" when num_train <= FULL_DATA_MAX; "sampled": never)."""
    if noise_examples not in NOISE_EXAMPLES:
        raise ValueError(f"sweep.noise_examples must be one of {NOISE_EXAMPLES}, got "
                         f"{noise_examples!r}")
    return noise_examples == "all" or (noise_examples == "auto" and num_train <= FULL_DATA_MAX)


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
    key = jax.random.fold_in(jax.random.key(seed + SEED_OFFSET), index)
    idx_h = jax.random.choice(key, num, (h,), replace=False)
    return grad_batch, dataset.take(arrays, idx_h.astype(jnp.int32), "train")


def resolve_b_noise(trace_h_sigma: float, g_h_g: float) -> tuple[float | None, str]:
    """(b_noise, "") when resolved, else (None, the reason in words).

    B_noise is unresolved when either window average is missing or non-finite, or when
    g_h_g ≤ 0 (its estimate is noisier than its size: more or larger measurements needed).
    """
    if not (math.isfinite(trace_h_sigma) and math.isfinite(g_h_g)):
        return None, "no finite curvature measurement near the crossing"
    if g_h_g <= 0:
        return None, (f"g_h_g = {g_h_g:.3g} <= 0 near the crossing (noise larger than the "
                      "signal: raise sweep.noise_batch_size or noise_hessian_batch_size)")
    if trace_h_sigma <= 0:
        return None, f"trace_h_sigma = {trace_h_sigma:.3g} <= 0 near the crossing"
    return trace_h_sigma / g_h_g, ""
