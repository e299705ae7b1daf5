"""Models (Flax NNX, built from `cbs.models.layers`) and the loss functions cbs differentiates.

    model = build_model(config.model, input_shape=ds.input_shape, num_classes=ds.num_classes,
                        rngs=nnx.Rngs(seed))
    graphdef, params, rest = split_model(model)          # nnx.split(model, nnx.Param, ...)
    loss_fn = make_loss_fn(graphdef, rest, ds.task)      # loss_fn(params, batch) -> mean loss

`default_model_config(name)` documents every field of the `model` sub-config. Modules:
`registry` (names to build functions; a new architecture registers there and is imported
below), `layers` (the shared layers), the architectures `mlp`, `cnn`, `transformer` and `lm`,
and `losses` (losses and evaluation).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import ml_collections
from flax import nnx

from cbs.models import cnn, lm, mlp, registry, transformer  # noqa: F401 - each registers
from cbs.models.losses import make_loss_fn, split_model

__all__ = [  # what it defines, and the three names of its modules that users take from here
    "build_model", "default_model_config", "make_loss_fn", "model_summary", "param_count",
    "register", "registry", "split_model",
]

register = registry.register
model_names = registry.names


def default_model_config(name: str = "mlp") -> ml_collections.ConfigDict:
    """The `model` sub-config for `name`, every field with its meaning."""
    c = ml_collections.ConfigDict()
    c.name = name  # architecture: a name registered in cbs.models.registry
    c.update(registry.get(name).default_config())
    return c


def build_model(model_config: ml_collections.ConfigDict, *, input_shape: Sequence[int],
                num_classes: int | None = None, vocab_size: int | None = None,
                rngs: nnx.Rngs, verbose: bool = True) -> nnx.Module:
    """The model `model_config` describes, for inputs as `registry.ModelInputs` holds them;
    `verbose` prints `model_summary` (process 0)."""
    inputs = registry.ModelInputs(tuple(input_shape), num_classes, vocab_size)
    model = registry.get(model_config.name).build(model_config, inputs, rngs)
    if verbose and jax.process_index() == 0:
        print(model_summary(model))
    return model


def abstract_model(model_config: ml_collections.ConfigDict, *, input_shape: Sequence[int],
                   num_classes: int | None = None, vocab_size: int | None = None,
                   seed: int = 0) -> nnx.Module:
    """The model with `jax.ShapeDtypeStruct` leaves (nothing allocated or computed), to
    validate a config; ValueError starting with "config.model" when it cannot be built."""
    try:
        return nnx.eval_shape(lambda: build_model(
            model_config, input_shape=input_shape, num_classes=num_classes,
            vocab_size=vocab_size, rngs=nnx.Rngs(seed), verbose=False))
    except (ValueError, TypeError, ZeroDivisionError) as err:
        text = " ".join(str(err).split())
        raise ValueError(text if text.startswith("config.model") else f"config.model: {text}"
                         ) from err


def param_count(model: nnx.Module) -> int:
    """Number of scalars in the model's `nnx.Param`s (BatchNorm statistics excluded)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def model_summary(model: nnx.Module) -> str:
    """One line: architecture, parameter count, initialisation scheme."""
    flag = "; couples examples (BatchNorm)" if getattr(model, "couples_examples", False) else ""
    return (f"{getattr(model, 'description', type(model).__name__)}: {param_count(model):,} "
            f"parameters; init: {getattr(model, 'init_scheme', 'unknown')}{flag}")
