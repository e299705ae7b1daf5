"""The jitted step's scalar metrics as one float32 vector read by name (`StepMetrics`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp


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
