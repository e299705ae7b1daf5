"""What the train step carries and returns: `TrainState` (everything an exact resume needs),
its exact example count, and `StepMetrics` (the step's scalars as one vector).

A count (`TrainState.examples_seen`) is int32 words [..., (high, low)] with value
high·2^30 + low and 0 <= low < 2^30, so adding a batch of up to 2^30 examples never
overflows a word (a plain int32 overflows at 2.1·10⁹). Host code keeps Python ints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cbs.stats import smoothing

__all__ = [
    "COUNT_BASE", "StatefulLoss", "StepMetrics", "TrainState", "count_add", "count_from_int",
    "count_int32", "count_to_int", "count_value", "init_train_state", "position", "stateless",
]

PyTree = Any
# loss_fn(params, model_state, batch) -> (mean loss, new model_state)
StatefulLoss = Callable[[PyTree, PyTree, PyTree], tuple[jax.Array, PyTree]]

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
    """(step, examples seen) of a `TrainState` as Python ints."""
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


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything on the device that an exact resume needs."""

    step: jax.Array  # int32 updates applied
    examples_seen: jax.Array  # E, examples consumed, a two-word count
    # float32 peak learning rate η_0: a value, not a constant of the compiled step, so trials
    # that differ only in η_0 share one compilation or one vmap
    learning_rate: jax.Array
    params: PyTree
    opt_state: PyTree  # optax state
    model_state: PyTree  # non-parameter model variables (BatchNorm statistics; else empty)
    noise_ema: PyTree  # `cbs.stats.smoothing.NoiseScaleEMA` of the step's live estimates
    measure_ema: PyTree  # the same of the every-k-steps measurements (b_noise reads it)

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    TrainState, data_fields=[f.name for f in dataclasses.fields(TrainState)], meta_fields=[])


def init_train_state(params: PyTree, direction: optax.GradientTransformation, *,
                     learning_rate: float = 1.0, model_state: PyTree = None,
                     ema_decay: float = 0.95) -> TrainState:
    """A fresh state at step 0 (jittable: call under `jax.jit` to place it on a mesh)."""
    return TrainState(step=jnp.zeros((), jnp.int32), examples_seen=jnp.zeros((2,), jnp.int32),
                      learning_rate=jnp.asarray(learning_rate, jnp.float32),
                      params=params, opt_state=direction.init(params),
                      model_state={} if model_state is None else model_state,
                      noise_ema=smoothing.NoiseScaleEMA.init(decay=ema_decay),
                      measure_ema=smoothing.NoiseScaleEMA.init(decay=ema_decay))


def stateless(loss_fn: Callable[[PyTree, PyTree], jax.Array]) -> StatefulLoss:
    """Wraps loss_fn(params, batch) into the (params, model_state, batch) form."""
    return lambda params, model_state, batch: (loss_fn(params, batch), model_state)


@jax.tree_util.register_pytree_node_class
class StepMetrics(Mapping):
    """The jitted step's scalar metrics as ONE float32 vector read by name (a Mapping, like
    the dict `TrainStep.apply` returns): one output buffer per step instead of one per
    metric, which on a step of a few milliseconds is a measurable share of its dispatch."""

    def __init__(self, names: tuple[str, ...], values: Any):
        self.names, self.array = names, values

    def __getitem__(self, name: str) -> Any:
        if name not in self.names:  # a Mapping's `in` and `get` need a KeyError
            raise KeyError(name)
        return self.array[self.names.index(name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __or__(self, other: Mapping) -> dict[str, Any]:
        return dict(self) | dict(other)

    def tree_flatten(self):
        return (self.array,), self.names

    @classmethod
    def tree_unflatten(cls, names, children):
        return cls(names, children[0])

    @classmethod
    def pack(cls, metrics: dict[str, jax.Array]) -> StepMetrics:
        names = tuple(metrics)
        bad = [k for k in names if jnp.ndim(metrics[k])]
        if bad:
            raise ValueError(f"step metrics must be scalars; not {bad}")
        return cls(names, jnp.stack([jnp.asarray(metrics[k], jnp.float32) for k in names]))
