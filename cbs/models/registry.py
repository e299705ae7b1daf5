"""The model registry: a model is one module plus one `register` call (example:
docs/guides/extending.md). `default_config` returns the architecture's fields of the `model`
sub-config, each with a trailing comment giving its meaning; `build(config, inputs, rngs)`
checks them, raising ValueError("model.<field>...") for a bad value, and builds the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import ml_collections
from flax import nnx

__all__ = [  # and `register`, public as cbs.models.register
    "BuildFn", "FlopsFn", "ModelInputs", "ModelSpec", "check_positive", "flops_per_example", "get",
    "names",
]


@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """What the data fixes about a model: input_shape of one example's "x" (no batch axis;
    [T] for a language model), num_classes (None = regression, one output), vocab_size."""

    input_shape: tuple[int, ...]
    num_classes: int | None = None
    vocab_size: int | None = None


BuildFn = Callable[[ml_collections.ConfigDict, ModelInputs, nnx.Rngs], nnx.Module]
FlopsFn = Callable[[ml_collections.ConfigDict, ModelInputs], float | None]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A registered architecture; `flops`: training FLOPs of one example (None: no MFU)."""

    name: str
    default_config: Callable[[], ml_collections.ConfigDict]
    build: BuildFn
    flops: FlopsFn | None = None


_MODELS: dict[str, ModelSpec] = {}


def register(name: str, *, default_config: Callable[[], ml_collections.ConfigDict],
             flops: FlopsFn | None = None) -> Callable[[BuildFn], BuildFn]:
    """Decorator registering `build` under `name` (a repeated name is an error)."""

    def wrap(build: BuildFn) -> BuildFn:
        if name in _MODELS:
            raise ValueError(f"model {name!r} is already registered")
        _MODELS[name] = ModelSpec(name, default_config, build, flops)
        return build

    return wrap


def names() -> tuple[str, ...]:
    """Registered model names, in registration order."""
    return tuple(_MODELS)


def flops_per_example(config: ml_collections.ConfigDict, inputs: ModelInputs) -> float | None:
    """Training FLOPs of one example of the model `config` describes (None: no formula)."""
    spec = get(config.name)
    return None if spec.flops is None else spec.flops(config, inputs)


def get(name: str) -> ModelSpec:
    """The registered model `name`; ValueError listing the known names otherwise."""
    if name not in _MODELS:
        raise ValueError(f"model.name: unknown model {name!r}; known: {list(_MODELS)}")
    return _MODELS[name]


def check_positive(config: ml_collections.ConfigDict, field: str, allow_zero: bool = False) -> None:
    """Raises ValueError unless `config[field]` is a (sequence of) positive integer(s)."""
    values = config[field]
    for v in values if isinstance(values, Sequence) else (values,):
        if not isinstance(v, int) or v < (0 if allow_zero else 1):
            raise ValueError(f"model.{field}={values!r} must be "
                             f"{'non-negative' if allow_zero else 'positive'} integer(s)")
