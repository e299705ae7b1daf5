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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from cbs import data
from cbs.stats import curvature, noise, trees

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]
SEED_OFFSET = 7919  # measurement batches use a stream independent of training's
CURVATURE_KEYS = ("trace_h_sigma", "mean_g_h_g", "g_h_g", "b_noise")


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
