"""Exact example counts on the device without 64-bit integers.

A count is int32 words [..., (high, low)] with value high·2^30 + low and 0 <= low < 2^30, so
adding a batch of up to 2^30 examples never overflows a word (a plain int32 overflows at
2.1·10⁹). Host code keeps Python ints (`count_to_int`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "COUNT_BASE", "count_add", "count_from_int", "count_int32", "count_to_int", "count_value",
    "position",
]

COUNT_BASE = 2**30


def count_from_int(n: int) -> jax.Array:
    """The two-word count of a non-negative Python int n < 2^61."""
    if not 0 <= int(n) < 2**61:
        raise ValueError(f"examples seen {n} is outside [0, 2^61)")
    return jnp.asarray(divmod(int(n), COUNT_BASE), jnp.int32)


def count_to_int(count: Any) -> int:
    """The Python int a (fetched) two-word count holds."""
    high, low = (int(v) for v in np.asarray(count).reshape(-1)[-2:])
    return high * COUNT_BASE + low


def position(state: Any) -> tuple[int, int]:
    """(step, examples seen) of a train state (`cbs.engine.step.TrainState`) as Python ints."""
    step, seen = jax.device_get((state.step, state.examples_seen))
    return int(step), count_to_int(seen)


def count_add(count: jax.Array, n: Any) -> jax.Array:
    """count + n for 0 <= n < 2^30 (a traced int32 or a Python int), carrying exactly."""
    low = count[..., 1] + jnp.asarray(n, jnp.int32)
    return jnp.stack([count[..., 0] + low // COUNT_BASE, low % COUNT_BASE], axis=-1)


def count_value(count: jax.Array) -> jax.Array:
    """The count as a float (float32: relative error 6·10⁻⁸, for learning-rate schedules)."""
    f = jnp.result_type(float)
    return count[..., 0].astype(f) * COUNT_BASE + count[..., 1].astype(f)


def count_int32(count: jax.Array) -> jax.Array:
    """The count modulo 2^31 as a non-negative int32 (the stream position of in-memory data,
    whose order therefore repeats after 2^31 examples)."""
    return (count[..., 0] % 2) * COUNT_BASE + count[..., 1]
