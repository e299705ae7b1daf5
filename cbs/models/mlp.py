"""Multilayer perceptron built from `cbs.models.layers.Linear` (fast per-example gradient norms).

Letters: B batch, D flattened input features, H hidden width, O outputs (classes, or 1 for
regression). A network with hidden sizes (H_1, ..., H_k) has
    sum_{j=1..k+1} (H_{j-1} + 1) H_j  parameters, with H_0 = D and H_{k+1} = O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import ml_collections
from flax import nnx

from cbs.models import layers
from cbs.models.registry import ModelInputs, check_positive, register

__all__ = ["ACTIVATIONS", "MLP", "build_mlp", "get_activation", "mlp_fields"]

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu, "gelu": jax.nn.gelu, "tanh": jax.nn.tanh, "silu": jax.nn.silu}


def get_activation(name: str, field: str = "model.activation") -> Callable[[jax.Array], jax.Array]:
    """Activation function by name; unknown names raise ValueError naming `field`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class MLP(nnx.Module):
    """Flatten, Linear → activation per hidden size, a Linear head: [B, ...] → [B, O]."""

    couples_examples = False

    def __init__(self, input_shape: Sequence[int], hidden_sizes: Sequence[int], out_features: int,
                 *, activation: str = "relu", rngs: nnx.Rngs):
        self._act = get_activation(activation)
        sizes = [math.prod(input_shape), *hidden_sizes, out_features]
        self.layers = nnx.List([layers.Linear(d_in, d_out, rngs=rngs)
                                for d_in, d_out in zip(sizes[:-1], sizes[1:], strict=True)])
        self.init_scheme = "kernels lecun_normal, biases zero"
        self.description = (f"MLP(in={sizes[0]}, hidden={tuple(hidden_sizes)}, out={out_features}, "
                            f"act={activation})")

    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        h_BxD = x_BxF.reshape(x_BxF.shape[0], -1)
        for layer in self.layers[:-1]:
            h_BxD = self._act(layer(h_BxD))
        return self.layers[-1](h_BxD)


def mlp_fields() -> ml_collections.ConfigDict:
    """The `model` fields of "mlp"."""
    c = ml_collections.ConfigDict()
    c.hidden_sizes = (128, 128)  # width of each hidden layer (depth = number of entries)
    c.activation = "relu"  # "relu" | "gelu" | "tanh" | "silu"
    return c


@register("mlp", default_config=mlp_fields)
def build_mlp(c: ml_collections.ConfigDict, inputs: ModelInputs, rngs: nnx.Rngs) -> MLP:
    check_positive(c, "hidden_sizes")
    out = 1 if inputs.num_classes is None else inputs.num_classes
    return MLP(inputs.input_shape, c.hidden_sizes, out, activation=c.activation, rngs=rngs)
