"""Models (Flax NNX, built from `cbs.models.layers`) and the loss functions cbs differentiates.

    model = build_model(config.model, input_shape=ds.input_shape, num_classes=ds.num_classes,
                        rngs=nnx.Rngs(seed))
    graphdef, params, rest = split_model(model)          # nnx.split(model, nnx.Param, ...)
    loss_fn = make_loss_fn(graphdef, rest, ds.task)      # loss_fn(params, batch) -> mean loss

`default_model_config(name)` documents every field of the `model` sub-config. Models whose
`couples_examples` attribute is True (CNN with BatchNorm) have no per-example loss in training
mode; see `cbs.models.losses`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import ml_collections
from flax import nnx

from cbs.models.cnn import CNN, NORMS
from cbs.models.losses import (
    TASKS,
    couples_examples,
    cross_entropy,
    make_eval_fn,
    make_loss_fn,
    per_example_loss,
    split_model,
)
from cbs.models.mlp import MLP
from cbs.models.transformer import POSITIONS, SIZES, TransformerLM

__all__ = [
    "CNN", "MLP", "MODEL_NAMES", "NORMS", "POSITIONS", "SIZES", "TASKS", "TransformerLM",
    "build_model", "couples_examples", "cross_entropy", "default_model_config", "make_eval_fn",
    "make_loss_fn", "model_summary", "param_count", "per_example_loss", "split_model",
]

MODEL_NAMES = ("mlp", "cnn", "transformer")


def default_model_config(name: str = "mlp") -> ml_collections.ConfigDict:
    """The `model` sub-config for `name`, every field with its meaning."""
    c = ml_collections.ConfigDict()
    c.name = name  # architecture: "mlp" | "cnn" | "transformer"
    if name == "mlp":
        c.hidden_sizes = (128, 128)  # width of each hidden layer (depth = number of entries)
        c.activation = "relu"  # "relu" | "gelu" | "tanh" | "silu"
    elif name == "cnn":
        c.channels = (16, 32)  # output channels of each conv block (conv → norm → act → pool)
        c.kernel_size = 3  # square conv kernel size (k × 1 for rank-1 inputs)
        c.pool = "max"  # 2×2 stride-2 pooling after each block: "max" | "avg"
        c.dense_sizes = (64,)  # hidden widths of the dense head before the output layer
        c.norm = "none"  # "none" | "layernorm" | "groupnorm" | "batchnorm" (couples examples)
        c.num_groups = 4  # groups of GroupNorm (must divide every entry of channels)
        c.ghost_batch_size = 0  # BatchNorm statistics over ghost batches of this many; 0 = batch
        c.activation = "relu"  # "relu" | "gelu" | "tanh" | "silu"
    elif name == "transformer":
        c.size = "tiny"  # row of cbs.models.SIZES: "tiny" | "small" | "10m" | "100m"
        c.d_model = 0  # model width D; 0 = from size
        c.num_layers = 0  # number of blocks L; 0 = from size
        c.num_heads = 0  # attention heads H (must divide d_model); 0 = from size
        c.d_ff = 0  # MLP hidden width F; 0 = from size
        c.max_len = 0  # longest sequence (learned position table); 0 = input length T
        c.positions = "rotary"  # "rotary" (no parameters) | "learned" (table [max_len, D])
        c.tie_embeddings = False  # output head = embedding^T (slow per-example path)
        c.use_bias = False  # biases in the attention and MLP projections
    else:
        raise ValueError(f"model.name={name!r} is not one of {MODEL_NAMES}")
    return c


def _positive(config: ml_collections.ConfigDict, field: str, allow_zero: bool = False) -> None:
    values = config[field]
    for v in values if isinstance(values, Sequence) else (values,):
        if not isinstance(v, int) or v < (0 if allow_zero else 1):
            raise ValueError(f"model.{field}={values!r} must be "
                             f"{'non-negative' if allow_zero else 'positive'} integer(s)")


def _build_transformer(c: ml_collections.ConfigDict, input_shape: Sequence[int],
                       vocab_size: int | None, rngs: nnx.Rngs) -> TransformerLM:
    if vocab_size is None:
        raise ValueError("model.name='transformer' needs vocab_size")
    if c.size not in SIZES:
        raise ValueError(f"model.size={c.size!r} is not one of {tuple(SIZES)}")
    for field in ("d_model", "num_layers", "num_heads", "d_ff", "max_len"):
        _positive(c, field, allow_zero=True)
    row = SIZES[c.size]
    return TransformerLM(vocab_size, c.max_len or int(input_shape[-1]),
                         d_model=c.d_model or row.d_model,
                         num_layers=c.num_layers or row.num_layers,
                         num_heads=c.num_heads or row.num_heads, d_ff=c.d_ff or row.d_ff,
                         positions=c.positions, tie_embeddings=c.tie_embeddings,
                         use_bias=c.use_bias, rngs=rngs)


def build_model(model_config: ml_collections.ConfigDict, *, input_shape: Sequence[int],
                num_classes: int | None = None, vocab_size: int | None = None,
                rngs: nnx.Rngs, verbose: bool = True) -> nnx.Module:
    """Builds the model that `model_config` (see `default_model_config`) describes.

    Args:
      input_shape: shape of one example's "x" (without the batch axis); [T] for the LM.
      num_classes: outputs of the MLP/CNN head; None means regression (one output).
      vocab_size: vocabulary of the transformer.
      rngs: initialisation randomness.
      verbose: print `model_summary` (process 0 only).
    """
    c = model_config
    if c.name not in MODEL_NAMES:
        raise ValueError(f"model.name={c.name!r} is not one of {MODEL_NAMES}")
    out = 1 if num_classes is None else num_classes
    if c.name == "mlp":
        _positive(c, "hidden_sizes")
        model = MLP(input_shape, c.hidden_sizes, out, activation=c.activation, rngs=rngs)
    elif c.name == "cnn":
        for field in ("channels", "kernel_size", "dense_sizes", "num_groups"):
            _positive(c, field)
        _positive(c, "ghost_batch_size", allow_zero=True)
        model = CNN(input_shape, out, channels=c.channels, kernel_size=c.kernel_size,
                    pool=c.pool, dense_sizes=c.dense_sizes, norm=c.norm,
                    num_groups=c.num_groups, ghost_batch_size=c.ghost_batch_size,
                    activation=c.activation, rngs=rngs)
    else:
        model = _build_transformer(c, input_shape, vocab_size, rngs)
    if verbose and jax.process_index() == 0:
        print(model_summary(model))
    return model


def param_count(model: nnx.Module) -> int:
    """Number of scalars in the model's `nnx.Param`s (BatchNorm statistics excluded)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def model_summary(model: nnx.Module) -> str:
    """One line: architecture, parameter count, initialisation scheme."""
    flag = "; couples examples (BatchNorm)" if getattr(model, "couples_examples", False) else ""
    return (f"{getattr(model, 'description', type(model).__name__)}: "
            f"{param_count(model):,} parameters; init: "
            f"{getattr(model, 'init_scheme', 'unknown')}{flag}")
