"""Per-layer rules of the ghost-norm pass: per-example squared parameter-gradient norms from a
layer's input and its output cotangent (see `cbs.stats.ghost` for the mechanism and the formulas).

Each rule takes (spec, x, g, params) with x the layer input [B, ...], g the cotangent of its
output [B, ..., O] (of the MEAN loss: `cbs.stats.ghost` rescales by B²) and returns one [B] array
per parameter of the call (None for parameters not tapped).

Letters: B batch, T positions (sequence or spatial, flattened), D input features, O output
features, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DENSE, CONV, EMBED, SCALE_SHIFT = "dense", "conv", "embed", "scale_shift"


def use_gram(t: int, d: int, o: int) -> bool:
    """Gram form costs T²(D+O) per example, the direct form T·D·O."""
    return t * (d + o) < d * o


def _kernel_sq_norm(x_BxTxD: jax.Array, g_BxTxO: jax.Array) -> jax.Array:
    _, t, d = x_BxTxD.shape
    o = g_BxTxO.shape[-1]
    if t == 1:
        return jnp.sum(jnp.square(x_BxTxD), (1, 2)) * jnp.sum(jnp.square(g_BxTxO), (1, 2))
    if use_gram(t, d, o):
        xx_BxTxT = jnp.einsum("btd,bsd->bts", x_BxTxD, x_BxTxD)
        gg_BxTxT = jnp.einsum("bto,bso->bts", g_BxTxO, g_BxTxO)
        return jnp.sum(xx_BxTxT * gg_BxTxT, (1, 2))
    grad_BxDxO = jnp.einsum("btd,bto->bdo", x_BxTxD, g_BxTxO)
    return jnp.sum(jnp.square(grad_BxDxO), (1, 2))


def _dense_rule(spec, x, g, params):
    b = x.shape[0]
    x_BxTxD = x.reshape(b, -1, x.shape[-1])
    g_BxTxO = g.reshape(b, -1, g.shape[-1])
    kernel_active, bias_active = (tuple(spec.active) + (False,))[:2]
    return (_kernel_sq_norm(x_BxTxD, g_BxTxO) if kernel_active else None,
            jnp.sum(jnp.square(g_BxTxO.sum(1)), 1) if bias_active else None)


def _patches(x_BxHxWxD: jax.Array, kh: int, kw: int, strides, padding) -> jax.Array:
    """[B, H', W', kh·kw·D] input windows of a convolution, by strided slices.

    `conv_general_dilated_patches` would do it as a convolution with a one-hot kernel, which
    costs (kh·kw·D)² multiply-adds per output position: more than the layer itself.
    """
    sh, sw = strides
    if isinstance(padding, str):
        padding = jax.lax.padtype_to_pads(x_BxHxWxD.shape[1:3], (kh, kw), strides, padding)
    x = jnp.pad(x_BxHxWxD, ((0, 0), *padding, (0, 0)))
    ho, wo = (x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1
    return jnp.concatenate([x[:, i:i + (ho - 1) * sh + 1:sh, j:j + (wo - 1) * sw + 1:sw]
                            for i in range(kh) for j in range(kw)], axis=-1)


def _conv_rule(spec, x, g, params):
    kh, kw = params[0].shape[:2]
    return _dense_rule(spec, _patches(x, kh, kw, *spec.options), g, params)


def _embed_rule(spec, ids, g, params):
    b, v = ids.shape[0], params[0].shape[0]
    ids_BxT = ids.reshape(b, -1)
    g_BxTxO = g.reshape(b, ids_BxT.shape[1], -1)
    if ids_BxT.shape[1] == 1:
        return (jnp.sum(jnp.square(g_BxTxO), (1, 2)),)
    if v < ids_BxT.shape[1]:
        onehot_BxTxV = jax.nn.one_hot(ids_BxT, v, dtype=g.dtype)
        grad_BxVxO = jnp.einsum("btv,bto->bvo", onehot_BxTxV, g_BxTxO)
        return (jnp.sum(jnp.square(grad_BxVxO), (1, 2)),)
    same_BxTxT = ids_BxT[:, :, None] == ids_BxT[:, None, :]
    gg_BxTxT = jnp.einsum("bto,bso->bts", g_BxTxO, g_BxTxO)
    return (jnp.sum(jnp.where(same_BxTxT, gg_BxTxT, 0), (1, 2)),)


def _scale_shift_rule(spec, xhat, g, params):
    out = []
    for p, active, with_x in zip(params, spec.active, (True, False), strict=True):
        if p is None or not active:
            out.append(None)
            continue
        per_ex = xhat * g if with_x else g
        lead = per_ex.ndim - p.ndim  # sum the axes the parameter broadcasts over
        grad_BxO = jnp.sum(per_ex, tuple(range(1, lead))) if lead > 1 else per_ex
        out.append(jnp.sum(jnp.square(grad_BxO), tuple(range(1, grad_BxO.ndim))))
    return tuple(out)


RULE_FNS = {DENSE: _dense_rule, CONV: _conv_rule, EMBED: _embed_rule,
             SCALE_SHIFT: _scale_shift_rule}
