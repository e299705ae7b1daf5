"""Float64 reference noise statistics: a per-example Python loop and a dense Hessian.

Deliberately naive (one jax.grad per example, jax.hessian of the flattened mean loss) so it
shares no code path with cbs.stats.noise. Only for small models (P < 2000).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree


def mlp_loss(p, b):
    """Mean softmax cross-entropy of the tanh MLP of `tiny_mlp` (module level: jit caches it)."""
    h = b["x"]
    for name in ("dense1", "dense2"):
        h = jnp.tanh(h @ p[name]["kernel"] + p[name]["bias"])
    logits = h @ p["out"]["kernel"] + p["out"]["bias"]
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, b["y"][:, None], -1)[:, 0]
    return jnp.mean(nll)


def tiny_mlp(dtype=jnp.float32, batch_size: int = 12, seed: int = 0):
    """(loss_fn, params, batch): tanh MLP 6-16-16-3, softmax cross-entropy, P = 435.

    Values are float32 numbers whatever `dtype`, so both precisions share one reference.
    """
    rng = np.random.default_rng(seed)
    sizes = [("dense1", 6, 16), ("dense2", 16, 16), ("out", 16, 3)]
    params = {name: {"kernel": rng.normal(0, 1.2 / np.sqrt(d), (d, o)),
                     "bias": rng.normal(0, 0.3, (o,))} for name, d, o in sizes}
    params = jax.tree.map(lambda x: jnp.asarray(x.astype(np.float32), dtype), params)
    batch = {"x": jnp.asarray(rng.normal(size=(batch_size, 6)).astype(np.float32), dtype),
             "y": jnp.asarray(rng.integers(0, 3, batch_size), jnp.int32)}

    return mlp_loss, params, batch


def _fields(batch_size, grads_BxP, hess_PxP, idx=None):
    """All NoiseStats fields from per-example gradients and a dense Hessian (float64 numpy)."""
    if idx is not None:
        grads_BxP, hess_PxP = grads_BxP[:, idx], hess_PxP[np.ix_(idx, idx)]
    mean_P = grads_BxP.mean(0)
    d_BxP = grads_BxP - mean_P
    trace_sigma = np.sum(d_BxP**2) / (batch_size - 1)
    trace_h_sigma = np.einsum("bp,pq,bq->", d_BxP, hess_PxP, d_BxP) / (batch_size - 1)
    mean_sq, mean_ghg = mean_P @ mean_P, mean_P @ hess_PxP @ mean_P
    grad_sq_norm = mean_sq - trace_sigma / batch_size
    g_h_g = mean_ghg - trace_h_sigma / batch_size
    out = dict(mean_grad_sq_norm=mean_sq, grad_sq_norm=grad_sq_norm, trace_sigma=trace_sigma,
               b_simple=trace_sigma / grad_sq_norm, mean_g_h_g=mean_ghg, g_h_g=g_h_g,
               trace_h_sigma=trace_h_sigma, b_noise=trace_h_sigma / g_h_g)
    # Relative condition numbers: the same sums with absolute values over |value| (Higham,
    # "Accuracy and Stability of Numerical Algorithms", §3.1), so float32 round-off in a
    # field is about ε·cond·|value|; ratios add their parts' conditions.
    abs_h = np.abs(hess_PxP)
    abs_ths = np.einsum("bp,pq,bq->", np.abs(d_BxP), abs_h, np.abs(d_BxP)) / (batch_size - 1)
    abs_ghg = np.abs(mean_P) @ abs_h @ np.abs(mean_P)
    cond = dict(mean_grad_sq_norm=1.0, trace_sigma=1.0,
                grad_sq_norm=(mean_sq + trace_sigma / batch_size) / abs(grad_sq_norm),
                mean_g_h_g=abs_ghg / abs(mean_ghg), trace_h_sigma=abs_ths / abs(trace_h_sigma),
                g_h_g=(abs_ghg + abs_ths / batch_size) / abs(g_h_g))
    cond["b_simple"] = cond["trace_sigma"] + cond["grad_sq_norm"]
    cond["b_noise"] = cond["trace_h_sigma"] + cond["g_h_g"]
    out["cond"] = cond
    return out


def reference_stats(loss_fn, params, batch, leaf_groups: list[str] | None = None) -> dict:
    """Float64 reference: {field: value, "cond": {field: condition number}, "sq_norms": [B],
    "groups": {name: {field: value, "cond": ...}}}.

    leaf_groups: group name of every leaf in jax.tree.leaves order (ravel_pytree's order).
    """
    with jax.enable_x64(True):
        params64 = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), params)
        batch64 = jax.tree.map(
            lambda x: jnp.asarray(np.asarray(x, np.float64 if np.issubdtype(x.dtype, np.floating)
                                             else x.dtype)), batch)
        flat, unravel = ravel_pytree(params64)
        batch_size = jax.tree.leaves(batch)[0].shape[0]
        grad_fn = jax.jit(lambda f, b: ravel_pytree(jax.grad(loss_fn)(unravel(f), b))[0])
        examples = [jax.tree.map(lambda x, i=i: x[i:i + 1], batch64) for i in range(batch_size)]
        grads_BxP = np.stack([np.asarray(grad_fn(flat, ex)) for ex in examples])
        hess_PxP = np.asarray(jax.jit(jax.hessian(lambda f: loss_fn(unravel(f), batch64)))(flat))
    out = _fields(batch_size, grads_BxP, hess_PxP)
    out["sq_norms"] = np.sum(grads_BxP**2, axis=1)
    if leaf_groups is not None:
        sizes = [np.size(x) for x in jax.tree.leaves(params)]
        leaf_of = np.repeat(np.arange(len(sizes)), sizes)
        out["groups"] = {}
        for name in dict.fromkeys(leaf_groups):
            members = [i for i, g in enumerate(leaf_groups) if g == name]
            idx = np.flatnonzero(np.isin(leaf_of, members))
            out["groups"][name] = _fields(batch_size, grads_BxP, hess_PxP, idx)
    return out


def reference_halves(loss_fn, params, batch, leaf_groups: list[str] | None = None) -> dict:
    """Float64 curvature fields of the drop-in's even/odd halves (`cbs.stats.dropin`): each
    half's deviations weighed by the dense Hessian of the other half's mean loss, averaged;
    {"groups": {name: fields}} per leaf group as in `reference_stats`."""
    with jax.enable_x64(True):
        params64 = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), params)
        batch64 = jax.tree.map(
            lambda x: jnp.asarray(np.asarray(x, np.float64 if np.issubdtype(x.dtype, np.floating)
                                             else x.dtype)), batch)
        flat, unravel = ravel_pytree(params64)
        size = jax.tree.leaves(batch)[0].shape[0]
        grad_fn = jax.jit(lambda f, b: ravel_pytree(jax.grad(loss_fn)(unravel(f), b))[0])
        grads_BxP = np.stack([np.asarray(grad_fn(flat, jax.tree.map(lambda x, i=i: x[i:i + 1],
                                                                    batch64)))
                              for i in range(size)])
        halves = [np.arange(s, size, 2) for s in (0, 1)]
        # one compiled Hessian for both halves (op by op, it took ~5 s on the first call)
        hess_fn = jax.jit(jax.hessian(lambda f, b: loss_fn(unravel(f), b)))
        hess = [np.asarray(hess_fn(flat, jax.tree.map(lambda x, h=h: x[h], batch64)))
                for h in halves]
    sizes = [np.size(x) for x in jax.tree.leaves(params)]
    leaf_of = np.repeat(np.arange(len(sizes)), sizes)
    names = list(dict.fromkeys(leaf_groups or []))
    subsets = {None: np.arange(flat.shape[0])}
    subsets.update({n: np.flatnonzero(np.isin(leaf_of, [i for i, g in enumerate(leaf_groups)
                                                         if g == n])) for n in names})
    out: dict = {"groups": {}}
    for name, idx in subsets.items():
        ths, ghg, ghg_u = [], [], []
        for h in (0, 1):
            g = grads_BxP[halves[h]][:, idx]
            hh = hess[1 - h][np.ix_(idx, idx)]
            d = g - g.mean(0)
            n = len(halves[h])
            ths.append(np.einsum("bp,pq,bq->", d, hh, d) / (n - 1))
            ghg.append(g.mean(0) @ hh @ g.mean(0))
            ghg_u.append(ghg[-1] - ths[-1] / n)
        fields = dict(trace_h_sigma=np.mean(ths), mean_g_h_g=np.mean(ghg), g_h_g=np.mean(ghg_u))
        fields["b_noise"] = fields["trace_h_sigma"] / fields["g_h_g"]
        if name is None:
            out.update(fields)
        else:
            out["groups"][name] = fields
    return out
