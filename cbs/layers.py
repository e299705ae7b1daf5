"""Standard layers (Flax NNX) whose per-example gradient norms cbs can compute cheaply.

These are drop-in equivalents of `nnx.Linear`, `nnx.Conv`, `nnx.Embed` and `nnx.LayerNorm`
with the same parameter names (`kernel`, `bias`, `embedding`, `scale`). Models built from
them get the fast ("ghost norm") path of `cbs.noise.exact`; any other layer still works and
falls back to `vmap` for its own parameters.

Letters: B batch, T positions (sequence or spatial), D input features, O output features.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

default_kernel_init = nnx.initializers.lecun_normal()


class Linear(nnx.Module):
    """y = x @ kernel + bias over the last axis. kernel: [D, O], bias: [O]."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                              kernel_init=default_kernel_init, rngs: nnx.Rngs):
        self.in_features, self.out_features = in_features, out_features
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features)))
        self.bias = nnx.Param(jnp.zeros((out_features,))) if use_bias else None

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        y = x_BxTxD @ self.kernel[...]
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Conv(nnx.Module):
    """2-D convolution, NHWC. kernel: [kh, kw, D, O], bias: [O]."""

    def __init__(self, in_features: int, out_features: int, kernel_size: Sequence[int], *,
                              strides: Sequence[int] | int = 1, padding: str = "SAME", use_bias: bool = True,
                              kernel_init=default_kernel_init, rngs: nnx.Rngs):
        kh, kw = kernel_size
        self.strides = (strides, strides) if isinstance(strides, int) else tuple(strides)
        self.padding = padding
        self.kernel = nnx.Param(kernel_init(rngs.params(), (kh, kw, in_features, out_features)))
        self.bias = nnx.Param(jnp.zeros((out_features,))) if use_bias else None

    def __call__(self, x_BxHxWxD: jax.Array) -> jax.Array:
        y = jax.lax.conv_general_dilated(
                x_BxHxWxD, self.kernel[...], self.strides, self.padding,
                dimension_numbers=("NHWC", "HWIO", "NHWC"))
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embed(nnx.Module):
    """Table lookup. embedding: [V, O]."""

    def __init__(self, num_embeddings: int, features: int, *,
                              embedding_init=nnx.initializers.normal(stddev=0.02), rngs: nnx.Rngs):
        self.embedding = nnx.Param(embedding_init(rngs.params(), (num_embeddings, features)))

    def __call__(self, ids_BxT: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids_BxT, axis=0)


class LayerNorm(nnx.Module):
    """Normalise over the last axis, then scale and shift. scale, bias: [O]."""

    def __init__(self, features: int, *, use_scale: bool = True, use_bias: bool = True,
                              epsilon: float = 1e-6, rngs: nnx.Rngs | None = None):
        del rngs
        self.epsilon = epsilon
        self.scale = nnx.Param(jnp.ones((features,))) if use_scale else None
        self.bias = nnx.Param(jnp.zeros((features,))) if use_bias else None

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        mean = jnp.mean(x_BxTxD, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x_BxTxD - mean), axis=-1, keepdims=True)
        y = (x_BxTxD - mean) * jax.lax.rsqrt(var + self.epsilon)
        if self.scale is not None:
            y = y * self.scale[...]
        if self.bias is not None:
            y = y + self.bias[...]
        return y
