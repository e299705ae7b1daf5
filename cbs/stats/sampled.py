"""Sampled and whole-training-set noise measurements, with B_noise unbiased by construction.

Letters: N training examples (the population: G, H and Σ are over them), 𝓑 the measured batch
(n examples: gradients), 𝓐 ⊆ 𝓑 its first m examples (deviations), 𝓒 an independent draw of h
examples (the Hessian Ĥ = ∇²L_𝓒), g_i per-example gradients, ḡ_𝓑 and ḡ_𝓐 means.

    trace_sigma, grad_sq_norm, b_simple      cbs.stats.noise.exact on 𝓑
    trace_h_sigma = Σ_{i∈𝓐} (g_i − ḡ_𝓐)ᵀ Ĥ (g_i − ḡ_𝓐) / (m − 1)
    mean_g_h_g    = ḡ_𝓑ᵀ Ĥ ḡ_𝓑
    g_h_g         = mean_g_h_g − trace_h_sigma / n
    b_noise       = trace_h_sigma / g_h_g

With 𝓒 independent of 𝓑 (a Hessian of the examples whose deviations it weighs adds each one's
own Hessian to its term), E[Ĥ | 𝓑] = H and every term is linear in Ĥ: for 𝓑 drawn without
replacement, E[trace_h_sigma] = Σ_i d_iᵀHd_i / (N − 1) and E[g_h_g] = GᵀHG − E[trace_h_sigma]/N.
Cost: m per-example gradients and m + 1 HVPs on h examples. Residual biases: E[g_h_g] and
E[grad_sq_norm] = |G|² − E[trace_sigma]/N (relative 1/(N·B_noise), 1/(N·B_simple)).

Full training set (`measure_full_data`, small N): G, |G|², tr(Σ) and GᵀHG exact over all N,
tr(HΣ) from the deviations d_i = g_i − G of a uniform subset 𝓐 of m examples drawn without
replacement (exactly unbiased for Σ_{i≤N} d_iᵀHd_i/(N − 1)):

    trace_sigma   = Σ_{i≤N} |g_i − G|² / (N − 1)
    grad_sq_norm  = mean_grad_sq_norm = |G|²
    g_h_g         = mean_g_h_g = GᵀHG
    trace_h_sigma = N/(N − 1) · (1/m) Σ_{i∈𝓐} d_iᵀ H d_i

Cost: one pass over N and m + 1 HVPs over N (or over h examples drawn independently of 𝓐).
Beyond `FULL_DATA_ONE_PASS` examples every sum runs over chunks of `FULL_DATA_CHUNK`
(`population_hvp`; tr(Σ) = N/(N − 1)·(mean |g_i|² − |G|²)): memory of one chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from cbs.stats import curvature, ghost, noise, trees
from cbs.stats.examples import LossFn, PyTree, one_example

__all__ = [
    "FULL_DATA_CHUNK", "FULL_DATA_METHOD", "FULL_DATA_ONE_PASS", "SAMPLED_METHOD",
    "full_data_method", "measure_full_data", "measure_noise", "population_hvp",
    "resolve_b_noise", "sampled_method",
]

SAMPLED_METHOD = "sampled"  # the registered name of `sampled_method`
FULL_DATA_METHOD = "full_data"  # the registered name of `full_data_method`
FULL_DATA_ONE_PASS = 32768  # up to this many training examples: one pass over all of them
FULL_DATA_CHUNK = 4096  # beyond it: examples per chunk, the chunks' sums added up


def measure_noise(loss_fn: LossFn, params: PyTree, grad_batch: PyTree,
                  hess_batch: PyTree | None = None, *, deviations: int = 0,
                  chunk_size: int | None = None) -> dict[str, jax.Array]:
    """`noise.SIMPLE_KEYS` of `grad_batch` (𝓑) and, with `hess_batch` (𝓒), the
    `noise.CURVATURE_KEYS` from the deviations of 𝓑's first `deviations` examples (m, 2 ≤ m ≤ n;
    0: all n), as float32 scalars (module docstring)."""
    stats = noise.exact(loss_fn, params, grad_batch, chunk_size=chunk_size)
    out = {k: getattr(stats, k) for k in noise.SIMPLE_KEYS}
    if hess_batch is not None:
        out |= _curvature(loss_fn, params, grad_batch, hess_batch, deviations, chunk_size)
    return {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}


def sampled_method(loss_fn: LossFn, params: PyTree, batch: PyTree, *, key: jax.Array | None = None,
                   curvature: bool = False, num_probes: int | None = None,
                   chunk_size: int | None = None, hessian_batch: PyTree | None = None,
                   deviations: int = 0) -> noise.NoiseStats:
    """The noise method "sampled": `measure_noise` on `batch` (𝓑), with `curvature` against
    `hessian_batch` (𝓒). `key` and `num_probes` are unused."""
    del key, num_probes
    if curvature and hessian_batch is None:
        raise ValueError("the sampled noise method needs a hessian_batch for curvature")
    return _noise_stats(batch, measure_noise(
        loss_fn, params, batch, hessian_batch if curvature else None, deviations=deviations,
        chunk_size=chunk_size))


def _noise_stats(batch: PyTree, out: dict[str, jax.Array]) -> noise.NoiseStats:
    stats: dict[str, Any] = {k: out.get(k) for k in noise.STAT_KEYS}
    return noise.NoiseStats(batch_size=jax.tree.leaves(batch)[0].shape[0], **stats)


noise.register_method(SAMPLED_METHOD, sampled_method, takes=("hessian_batch", "deviations"))


def full_data_method(loss_fn: LossFn, params: PyTree, batch: PyTree, *,
                     key: jax.Array | None = None, curvature: bool = False,
                     num_probes: int | None = None, chunk_size: int | None = None,
                     deviations: int = 0, hessian_examples: int = 0) -> noise.NoiseStats:
    """The noise method "full_data": `measure_full_data` on `batch`, all N training examples
    (curvature only with `curvature`). `num_probes` is unused."""
    del num_probes
    return _noise_stats(batch, measure_full_data(
        loss_fn, params, batch, key, deviations=deviations if curvature else 0,
        hessian_examples=hessian_examples, chunk_size=chunk_size))


noise.register_method(FULL_DATA_METHOD, full_data_method, takes=("deviations", "hessian_examples"))


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
        d = jax.tree.map(jnp.subtract, jax.grad(loss_fn)(params, one_example(example)), grad_m)
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
    """Noise statistics of all N examples of `train_batch` (module docstring), float32:
    `noise.SIMPLE_KEYS` and, when `deviations` (m) > 0, `noise.CURVATURE_KEYS` from m examples
    drawn with `key` (m ≥ N: every example). `hessian_examples`: 0 (or ≥ N): trace_h_sigma's H
    over all N; h > 0: H of h examples drawn independently of 𝓐 (still unbiased, at h/N of the
    HVP cost). GᵀHG always uses all N."""
    num = jax.tree.leaves(train_batch)[0].shape[0]
    trace_sigma, grad_sq_norm = _population_noise(loss_fn, params, train_batch, chunk_size)
    # |G|², exact: G is the population gradient
    out = {"trace_sigma": trace_sigma, "grad_sq_norm": grad_sq_norm,
           "mean_grad_sq_norm": grad_sq_norm, "b_simple": trace_sigma / grad_sq_norm}
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


def _chunk_mean(f: Callable, batch: PyTree, chunk: int) -> PyTree:
    """Σ_k (n_k/N) f(chunk_k) over chunks of at most `chunk` examples: the mean over all N."""
    num = jax.tree.leaves(batch)[0].shape[0]
    whole, rest = divmod(num, chunk)
    chunks = jax.tree.map(lambda x: x[:whole * chunk].reshape(whole, chunk, *x.shape[1:]), batch)

    def add(total, b):
        return jax.tree.map(lambda t, x: t + x * (chunk / num), total, f(b)), None

    zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(f, jax.tree.map(lambda x: x[0], chunks)))
    total, _ = jax.lax.scan(add, zero, chunks)
    if rest:
        tail = f(jax.tree.map(lambda x: x[whole * chunk:], batch))
        total = jax.tree.map(lambda t, x: t + x * (rest / num), total, tail)
    return total


def population_hvp(loss_fn: LossFn, params: PyTree, batch: PyTree,
                   one_pass: int = FULL_DATA_ONE_PASS, chunk: int = FULL_DATA_CHUNK
                   ) -> tuple[PyTree, Callable]:
    """(G, v ↦ Hv) of the mean loss over all N examples of `batch`: `curvature.hvp_fn` for
    N ≤ `one_pass`; else sums over chunks of `chunk` examples weighted by n_k/N, each HVP
    recomputing its chunk's forward pass (memory of one chunk, ~1.5× the FLOPs)."""
    num = jax.tree.leaves(batch)[0].shape[0]
    if num <= one_pass:
        return curvature.hvp_fn(loss_fn, params, batch)
    grad_of = jax.grad(loss_fn)

    def hvp(v):
        v = trees.tree_cast_like(v, params)
        return _chunk_mean(lambda b: jax.jvp(lambda p: grad_of(p, b), (params,), (v,))[1],
                           batch, chunk)

    return _chunk_mean(lambda b: grad_of(params, b), batch, chunk), hvp


def _population_noise(loss_fn: LossFn, params: PyTree, batch: PyTree, chunk_size: int | None
                      ) -> tuple[jax.Array, jax.Array]:
    """(tr(Σ), |G|²) over all N examples, in chunks beyond `FULL_DATA_ONE_PASS`."""
    num = jax.tree.leaves(batch)[0].shape[0]
    if num <= FULL_DATA_ONE_PASS:
        stats = noise.exact(loss_fn, params, batch, chunk_size=chunk_size)
        return stats.trace_sigma, stats.mean_grad_sq_norm

    def part(b):
        _, grad, sq = ghost.per_example_grads_info(loss_fn, params, b, chunk_size=chunk_size)
        dtype = trees.accum_dtype()
        return trees.tree_cast(grad, dtype), sum(jnp.mean(x.astype(dtype))
                                                 for x in jax.tree.leaves(sq))

    grad, mean_sq = _chunk_mean(part, batch, FULL_DATA_CHUNK)
    grad_sq_norm = trees.tree_sq_norm(grad)
    return (mean_sq - grad_sq_norm) * num / (num - 1), grad_sq_norm


def _full_curvature(loss_fn, params, train_batch, key, m, h, chunk_size):
    num = jax.tree.leaves(train_batch)[0].shape[0]
    if m < 1:
        raise ValueError(f"the curvature measurement needs >= 1 deviation example, got {m}")
    dtype = trees.accum_dtype()
    grad, hvp = population_hvp(loss_fn, params, train_batch, FULL_DATA_ONE_PASS, FULL_DATA_CHUNK)
    g_h_g = trees.tree_dot(grad, hvp(grad))
    key_a, key_c = (None, None) if key is None else jax.random.split(key)
    subset = _draw(train_batch, key_a, m, num)
    hessian_num = h if h and h < num else num  # examples of the Hessian of tr(HΣ)
    if hessian_num < num:
        _, hvp = population_hvp(loss_fn, params, _draw(train_batch, key_c, h, num),
                                FULL_DATA_ONE_PASS, FULL_DATA_CHUNK)
    grad_acc = trees.tree_cast(grad, dtype)

    def form(example):
        g = jax.grad(loss_fn)(params, one_example(example))
        d = jax.tree.map(jnp.subtract, trees.tree_cast(g, dtype), grad_acc)
        return trees.tree_dot(d, hvp(d))

    # deviations side by side (vmap) only while an HVP is one pass over at most a chunk
    side_by_side = min(chunk_size or m, m) if hessian_num <= FULL_DATA_ONE_PASS else 1
    try:
        forms = jax.lax.map(form, subset, batch_size=side_by_side)
    except NotImplementedError:  # jax has no batching rule for this model's HVP (a conv's
        forms = jax.lax.map(form, subset)  # kernel gradient under a mesh): one at a time
    trace_h_sigma = jnp.mean(forms) * num / (num - 1)
    return {"trace_h_sigma": trace_h_sigma, "mean_g_h_g": g_h_g, "g_h_g": g_h_g,
            "b_noise": trace_h_sigma / g_h_g}


def resolve_b_noise(trace_h_sigma: float, g_h_g: float) -> tuple[float | None, str]:
    """(b_noise, "") when resolved, else (None, the reason): either window average missing
    or non-finite, or g_h_g ≤ 0 or trace_h_sigma ≤ 0 (the estimate noisier than its size)."""
    if not (math.isfinite(trace_h_sigma) and math.isfinite(g_h_g)):
        return None, "no finite curvature measurement near the crossing"
    if g_h_g <= 0:
        return None, (f"g_h_g = {g_h_g:.3g} <= 0 near the crossing (noise larger than the "
                      "signal: raise noise.batch_size or noise.hessian_batch_size)")
    if trace_h_sigma <= 0:
        return None, f"trace_h_sigma = {trace_h_sigma:.3g} <= 0 near the crossing"
    return trace_h_sigma / g_h_g, ""
