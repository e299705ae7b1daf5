"""Small convolutional classifier: conv blocks (conv → norm → activation → 2×2 pool), dense head.

Letters: B batch, H, W spatial size, C channels, G ghost-batch size, K = B / G ghost batches.

Normalisation (`norm`): "none" (convolutions carry a bias), "layernorm" (over the channels
of each position), "groupnorm" (over (H, W, C/groups) of each example), or "batchnorm"
(`nnx.BatchNorm` over ghost batches of G examples in training mode, G = 0: the whole batch;
it couples examples, so `couples_examples = True`).

Inputs of rank 1 ([L], e.g. a 1-D signal) are treated as [L, 1, 1] with (k, 1) kernels; inputs
of rank 2 ([H, W]) get one channel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from cbs.models import layers
from cbs.models.mlp import get_activation
from cbs.models.registry import ModelInputs, check_positive, register

__all__ = ["CNN", "NORMS", "GhostBatchNorm", "build_cnn", "cnn_fields"]

NORMS = ("none", "layernorm", "groupnorm", "batchnorm")


class GhostBatchNorm(nnx.Module):
    """`nnx.BatchNorm` whose training statistics come from ghost batches of `ghost_batch_size`
    (running averages: the mean over ghost batches of their means and biased variances). Eval
    mode and ghost_batch_size 0 or >= B defer to `nnx.BatchNorm` itself."""

    def __init__(self, features: int, *, ghost_batch_size: int = 0, momentum: float = 0.99,
                 rngs: nnx.Rngs):
        self.ghost_batch_size = ghost_batch_size
        self.bn = nnx.BatchNorm(features, momentum=momentum, rngs=rngs)

    def __call__(self, x_BxHxWxC: jax.Array) -> jax.Array:
        b, g = x_BxHxWxC.shape[0], self.ghost_batch_size
        if self.bn.use_running_average or g <= 0 or g >= b:
            return self.bn(x_BxHxWxC)
        if b % g:
            raise ValueError(f"batch size {b} is not divisible by model.ghost_batch_size={g}")
        x_KxGxHxWxC = x_BxHxWxC.reshape(b // g, g, *x_BxHxWxC.shape[1:])
        inner = tuple(range(1, x_KxGxHxWxC.ndim - 1))  # G, H, W
        mean_Kx1x1x1xC = jnp.mean(x_KxGxHxWxC, axis=inner, keepdims=True)
        var_Kx1x1x1xC = jnp.var(x_KxGxHxWxC, axis=inner, keepdims=True)
        y = (x_KxGxHxWxC - mean_Kx1x1x1xC) * jax.lax.rsqrt(var_Kx1x1x1xC + self.bn.epsilon)
        scale, bias = cast(nnx.Param, self.bn.scale), cast(nnx.Param, self.bn.bias)  # both on
        y = y * scale[...] + bias[...]
        m, outer = self.bn.momentum, tuple(range(x_KxGxHxWxC.ndim - 1))
        self.bn.mean[...] = m * self.bn.mean[...] + (1 - m) * jnp.mean(mean_Kx1x1x1xC, outer)
        self.bn.var[...] = m * self.bn.var[...] + (1 - m) * jnp.mean(var_Kx1x1x1xC, outer)
        return y.reshape(x_BxHxWxC.shape)


def _make_norm(norm: str, channels: int, *, num_groups: int, ghost_batch_size: int,
               rngs: nnx.Rngs) -> nnx.Module | None:
    if norm == "none":
        return None
    if norm == "layernorm":
        return layers.LayerNorm(channels, rngs=rngs)
    if norm == "groupnorm":
        if channels % num_groups:
            raise ValueError(f"model.num_groups={num_groups} does not divide {channels} channels")
        return layers.GroupNorm(channels, num_groups=num_groups, rngs=rngs)
    if norm == "batchnorm":
        return GhostBatchNorm(channels, ghost_batch_size=ghost_batch_size, rngs=rngs)
    raise ValueError(f"model.norm={norm!r} is not one of {NORMS}")


class CNN(nnx.Module):
    """Conv blocks then an MLP head: float [B, *input_shape] → [B, O]."""

    def __init__(self, input_shape: Sequence[int], out_features: int, *,
                 channels: Sequence[int] = (16, 32), kernel_size: int = 3, pool: str = "max",
                 dense_sizes: Sequence[int] = (64,), norm: str = "none", num_groups: int = 4,
                 ghost_batch_size: int = 0, activation: str = "relu", rngs: nnx.Rngs):
        if pool not in ("max", "avg"):
            raise ValueError(f"model.pool={pool!r} is not one of ('max', 'avg')")
        if len(input_shape) not in (1, 2, 3):
            raise ValueError(f"CNN input_shape must have rank 1, 2 or 3, got {tuple(input_shape)}")
        self.image_shape = tuple(input_shape) + (1,) * (3 - len(input_shape))
        h, w, c = self.image_shape
        kernel = (kernel_size, kernel_size if w > 1 else 1)
        self._act = get_activation(activation)
        self.pool = pool
        self.couples_examples = norm == "batchnorm"
        convs, norms = [], []
        for c_out in channels:
            convs.append(layers.Conv(c, c_out, kernel, use_bias=norm == "none", rngs=rngs))
            norms.append(_make_norm(norm, c_out, num_groups=num_groups,
                                    ghost_batch_size=ghost_batch_size, rngs=rngs))
            h, w, c = max(h // 2, 1), max(w // 2, 1), c_out
        self.convs, self.norms = nnx.List(convs), nnx.List(norms)
        sizes = [h * w * c, *dense_sizes, out_features]
        self.dense = nnx.List([layers.Linear(d_in, d_out, rngs=rngs)
                               for d_in, d_out in zip(sizes[:-1], sizes[1:], strict=True)])
        self.init_scheme = "kernels lecun_normal, biases zero, norm scales one"
        ghost = f", ghost_batch={ghost_batch_size}" if norm == "batchnorm" else ""
        self.description = (f"CNN(in={self.image_shape}, channels={tuple(channels)}, "
                            f"kernel={kernel}, pool={pool}, dense={tuple(dense_sizes)}, "
                            f"out={out_features}, norm={norm}{ghost}, act={activation})")

    def _pool(self, x_BxHxWxC: jax.Array) -> jax.Array:
        """2×2 stride-2 VALID pooling (1 along a size-1 axis), the values of `nnx.max_pool`,
        as a reshape and a reduction: on XLA:CPU the gradient of the `reduce_window` form took
        two thirds of the default CNN's training step."""
        b, h, w, c = x_BxHxWxC.shape
        wh, ww = (2 if h > 1 else 1), (2 if w > 1 else 1)
        x = x_BxHxWxC[:, :h // wh * wh, :w // ww * ww]
        x_BxHxWHxWxWWxC = x.reshape(b, h // wh, wh, w // ww, ww, c)
        reduce = jnp.max if self.pool == "max" else jnp.mean
        return reduce(x_BxHxWHxWxWWxC, axis=(2, 4))

    def __call__(self, x: jax.Array) -> jax.Array:
        h_BxHxWxC = x.reshape(x.shape[0], *self.image_shape)
        for conv, norm in zip(self.convs, self.norms, strict=True):
            h_BxHxWxC = conv(h_BxHxWxC)
            if norm is not None:
                h_BxHxWxC = norm(h_BxHxWxC)
            h_BxHxWxC = self._pool(self._act(h_BxHxWxC))
        h_BxD = h_BxHxWxC.reshape(h_BxHxWxC.shape[0], -1)
        for layer in self.dense[:-1]:
            h_BxD = self._act(layer(h_BxD))
        return self.dense[-1](h_BxD)


def cnn_fields() -> ml_collections.ConfigDict:
    """The `model` fields of "cnn"."""
    c = ml_collections.ConfigDict()
    c.channels = (16, 32)  # output channels of each conv block (conv → norm → act → pool)
    c.kernel_size = 3  # square conv kernel size (k × 1 for rank-1 inputs)
    c.pool = "max"  # 2×2 stride-2 pooling after each block: "max" | "avg"
    c.dense_sizes = (64,)  # hidden widths of the dense head before the output layer
    c.norm = "none"  # "none" | "layernorm" | "groupnorm" | "batchnorm" (couples examples)
    c.num_groups = 4  # groups of GroupNorm (must divide every entry of channels)
    c.ghost_batch_size = 0  # BatchNorm statistics over ghost batches of this many; 0 = batch
    c.activation = "relu"  # "relu" | "gelu" | "tanh" | "silu"
    return c


@register("cnn", default_config=cnn_fields)
def build_cnn(c: ml_collections.ConfigDict, inputs: ModelInputs, rngs: nnx.Rngs) -> CNN:
    for field in ("channels", "kernel_size", "dense_sizes", "num_groups"):
        check_positive(c, field)
    check_positive(c, "ghost_batch_size", allow_zero=True)
    out = 1 if inputs.num_classes is None else inputs.num_classes
    return CNN(inputs.input_shape, out, **{k: c[k] for k in cnn_fields()}, rngs=rngs)
