"""Standard layers (Flax NNX): drop-in equivalents of `nnx.Linear`, `nnx.Conv`, `nnx.Embed`,
`nnx.LayerNorm` and `nnx.GroupNorm` with the same parameter names (`kernel`, `bias`,
`embedding`, `scale`), nothing special to the noise statistics.

Letters: B batch, T positions (sequence or spatial), D input features, O output features,
V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Conv", "Embed", "GroupNorm", "LayerNorm", "Linear"]

_default_kernel_init = nnx.initializers.lecun_normal()
_default_embedding_init = nnx.initializers.normal(stddev=0.02)


def _scale_shift(xhat: jax.Array, scale_O: nnx.Param | None, bias_O: nnx.Param | None
                 ) -> jax.Array:
    """xhat * scale + bias, broadcast over the trailing axes."""
    y = xhat if scale_O is None else xhat * scale_O[...]
    return y if bias_O is None else y + bias_O[...]


class Linear(nnx.Module):
    """y = x @ kernel + bias over the last axis. kernel: [D, O], bias: [O]."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 kernel_init=_default_kernel_init, rngs: nnx.Rngs):
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features)))
        self.bias = nnx.Param(jnp.zeros((out_features,))) if use_bias else None

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        y_BxTxO = x_BxTxD @ self.kernel[...]
        return y_BxTxO if self.bias is None else y_BxTxO + self.bias[...]


class Conv(nnx.Module):
    """2-D convolution, NHWC. kernel: [kh, kw, D, O], bias: [O]."""

    def __init__(self, in_features: int, out_features: int, kernel_size: Sequence[int], *,
                 strides: Sequence[int] | int = 1, padding: str = "SAME", use_bias: bool = True,
                 kernel_init=_default_kernel_init, rngs: nnx.Rngs):
        kh, kw = kernel_size
        self.strides = (strides, strides) if isinstance(strides, int) else tuple(strides)
        self.padding = padding if isinstance(padding, str) else tuple(map(tuple, padding))
        self.kernel = nnx.Param(kernel_init(rngs.params(), (kh, kw, in_features, out_features)))
        self.bias = nnx.Param(jnp.zeros((out_features,))) if use_bias else None

    def __call__(self, x_BxHxWxD: jax.Array) -> jax.Array:
        y = jax.lax.conv_general_dilated(x_BxHxWxD, self.kernel[...], self.strides, self.padding,
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return y if self.bias is None else y + self.bias[...]


class Embed(nnx.Module):
    """Table lookup. embedding: [V, O]."""

    def __init__(self, num_embeddings: int, features: int, *,
                 embedding_init=_default_embedding_init, rngs: nnx.Rngs):
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
        xhat = (x_BxTxD - mean) * jax.lax.rsqrt(var + self.epsilon)
        return _scale_shift(xhat, self.scale, self.bias)


class GroupNorm(nnx.Module):
    """Normalise each example over all non-batch axes within channel groups (channels last),
    then scale and shift per channel. scale, bias: [O]. Matches `nnx.GroupNorm`'s defaults."""

    def __init__(self, num_features: int, num_groups: int | None = 32,
                 group_size: int | None = None, *, epsilon: float = 1e-6,
                 use_scale: bool = True, use_bias: bool = True, rngs: nnx.Rngs | None = None):
        del rngs
        if (num_groups is None) == (group_size is None):
            raise ValueError("give exactly one of num_groups and group_size")
        if num_groups is None:
            num_groups = num_features // cast(int, group_size)  # exactly one is given
        if num_groups < 1 or num_features % num_groups:
            raise ValueError(f"num_features={num_features} is not divisible into "
                             f"{num_groups} groups")
        self.num_groups, self.epsilon = num_groups, epsilon
        self.scale = nnx.Param(jnp.ones((num_features,))) if use_scale else None
        self.bias = nnx.Param(jnp.zeros((num_features,))) if use_bias else None

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        b, *_, d = x_BxTxD.shape
        x_BxTxGxK = x_BxTxD.reshape(b, -1, self.num_groups, d // self.num_groups)
        mean = jnp.mean(x_BxTxGxK, axis=(1, 3), keepdims=True)
        var = jnp.mean(jnp.square(x_BxTxGxK - mean), axis=(1, 3), keepdims=True)
        xhat = ((x_BxTxGxK - mean) * jax.lax.rsqrt(var + self.epsilon)).reshape(x_BxTxD.shape)
        return _scale_shift(xhat, self.scale, self.bias)
