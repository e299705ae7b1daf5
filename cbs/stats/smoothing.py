"""Estimates from scalars: the two-batch solve for |G|² and tr(Σ), and the bias-corrected
EMA of a noise scale's numerator and denominator (McCandlish et al. 2018, App. A).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cbs.stats import trees

__all__ = ["NoiseScaleEMA", "two_batch"]


def two_batch(sq_norm_small: jax.Array, sq_norm_big: jax.Array, b_small, b_big
              ) -> tuple[jax.Array, jax.Array]:
    """Unbiased (|G|², tr Σ) from |ḡ|² at two batch sizes (E|ḡ_b|² = |G|² + tr Σ / b):
    grad_sq_norm = (b_big |ḡ_big|² − b_small |ḡ_small|²) / (b_big − b_small) and
    trace_sigma = (|ḡ_small|² − |ḡ_big|²) / (1/b_small − 1/b_big); their ratio is biased
    (smooth both with `NoiseScaleEMA` first)."""
    concrete = all(isinstance(b, int | float | np.number) for b in (b_small, b_big))
    if concrete and not 0 < b_small < b_big:
        raise ValueError(f"two_batch needs 0 < b_small < b_big, got b_small={b_small}, "
                         f"b_big={b_big}: pass the smaller batch's norm first.")
    dtype = trees.accum_dtype()
    s_small, s_big = jnp.asarray(sq_norm_small, dtype), jnp.asarray(sq_norm_big, dtype)
    b_small, b_big = jnp.asarray(b_small, dtype), jnp.asarray(b_big, dtype)
    grad_sq_norm = (b_big * s_big - b_small * s_small) / (b_big - b_small)
    trace_sigma = (s_small - s_big) * b_small * b_big / (b_big - b_small)
    return grad_sq_norm, trace_sigma


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoiseScaleEMA:
    """Bias-corrected EMAs of numerator and denominator; the noise scale is their ratio.

    avg ← decay·avg + (1 − decay)·x, reported as avg / (1 − decay^count) (Adam's correction).
    The curvature pair has its own count: it is updated only when it is fed.
    """

    decay: float = dataclasses.field(metadata=dict(static=True))
    count: jax.Array
    avg_grad_sq_norm: jax.Array
    avg_trace_sigma: jax.Array
    count_curvature: jax.Array
    avg_g_h_g: jax.Array
    avg_trace_h_sigma: jax.Array

    @classmethod
    def init(cls, decay: float = 0.95) -> NoiseScaleEMA:
        """Empty EMA (every smoothed value is nan until the first update)."""
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}.")
        zero, n = jnp.zeros((), trees.accum_dtype()), jnp.zeros((), jnp.int32)
        return cls(decay, n, zero, zero, n, zero, zero)

    def update(self, grad_sq_norm: jax.Array, trace_sigma: jax.Array, *,
               trace_h_sigma: jax.Array | None = None,
               g_h_g: jax.Array | None = None) -> NoiseScaleEMA:
        """Returns the EMA after one more (unbiased) measurement."""
        if (trace_h_sigma is None) != (g_h_g is None):
            raise ValueError("pass trace_h_sigma and g_h_g together (or neither).")
        mix = lambda avg, x: self.decay * avg + (1.0 - self.decay) * jnp.asarray(x, avg.dtype)
        new = dict(count=self.count + 1, avg_grad_sq_norm=mix(self.avg_grad_sq_norm, grad_sq_norm),
                   avg_trace_sigma=mix(self.avg_trace_sigma, trace_sigma))
        if g_h_g is not None:
            new.update(count_curvature=self.count_curvature + 1,
                       avg_g_h_g=mix(self.avg_g_h_g, g_h_g),
                       avg_trace_h_sigma=mix(self.avg_trace_h_sigma, trace_h_sigma))
        return dataclasses.replace(self, **new)

    def _corrected(self, avg: jax.Array, count: jax.Array) -> jax.Array:
        return avg / (1.0 - jnp.asarray(self.decay, avg.dtype) ** count)

    grad_sq_norm = property(lambda self: self._corrected(self.avg_grad_sq_norm, self.count))
    trace_sigma = property(lambda self: self._corrected(self.avg_trace_sigma, self.count))
    g_h_g = property(lambda self: self._corrected(self.avg_g_h_g, self.count_curvature))
    trace_h_sigma = property(
        lambda self: self._corrected(self.avg_trace_h_sigma, self.count_curvature))
    b_simple = property(lambda self: self.trace_sigma / self.grad_sq_norm)
    b_noise = property(lambda self: self.trace_h_sigma / self.g_h_g)

    def to_dict(self, prefix: str = "noise/ema_") -> dict[str, Any]:
        """Flat metrics `noise/ema_b_simple`, `noise/ema_grad_sq_norm`, ..."""
        names = ["b_simple", "grad_sq_norm", "trace_sigma", "b_noise", "g_h_g", "trace_h_sigma"]
        return {prefix + n: getattr(self, n) for n in names}
