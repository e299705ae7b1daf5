"""Per-example losses and the `loss_fn(params, batch)` builders that the rest of cbs consumes.

Letters: B batch, T positions, C classes, V vocabulary.

`loss_fn(params, batch)` rebuilds the model with `nnx.merge` on every call, so it is pure and
can be jitted, differentiated and vmapped. Per-example loss ℓ_i (`loss_fn` returns the mean
over the batch, docs/design.md), in float32 (float64 when the inputs are float64):
- "classification": ℓ_i = logsumexp(z_i) − z_{i, y_i}, logits z [B, C], labels int [B].
- "lm": ℓ_i = (1/T) Σ_t [logsumexp(z_it) − z_{it, y_it}], logits [B, T, V], labels [B, T]:
  the example's mean token loss.
- "regression": ℓ_i = ½ (f(x_i) − y_i)², predictions [B] or [B, 1], targets [B].
Models that couple examples (BatchNorm in training mode) have no per-example loss:
`loss_fn.couples_examples` is True for them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [  # and, public as cbs.models.make_loss_fn and cbs.models.split_model, those two
    "TASKS", "Batch", "couples_examples", "cross_entropy", "make_eval_fn", "per_example_correct",
    "per_example_loss",
]

Batch = dict[str, jax.Array]
TASKS = ("classification", "lm", "regression")


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, params, rest) = nnx.split(model, nnx.Param, ...)."""
    # nnx.split returns one State per filter; its stub cannot count them
    return nnx.split(model, nnx.Param, ...)  # type: ignore[return-value]


def _float(x: jax.Array) -> jax.Array:
    return x if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize >= 4 else (
        x.astype(jnp.float32))


def cross_entropy(logits_BxC: jax.Array, labels_B: jax.Array) -> jax.Array:
    """Softmax cross-entropy per example [B] (any leading axes) from integer labels."""
    logits_BxC = _float(logits_BxC)
    picked_B = jnp.take_along_axis(logits_BxC, labels_B[..., None].astype(jnp.int32), axis=-1)
    return jax.nn.logsumexp(logits_BxC, axis=-1) - picked_B[..., 0]


def per_example_loss(outputs: jax.Array, targets: jax.Array, task: str) -> jax.Array:
    """ℓ_i for each example, shape [B] (see the module docstring)."""
    _check_task(task)
    if task == "regression":
        return 0.5 * jnp.square(_float(outputs).reshape(targets.shape) - targets)
    loss = cross_entropy(outputs, targets)
    return jnp.mean(loss, axis=-1) if task == "lm" else loss


def per_example_correct(outputs: jax.Array, targets: jax.Array, task: str) -> jax.Array:
    """Accuracy of each example, shape [B]: 0/1 for classification, token accuracy for lm."""
    hits = (jnp.argmax(outputs, axis=-1) == targets).astype(jnp.float32)
    return jnp.mean(hits, axis=-1) if task == "lm" else hits


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not one of {TASKS}")


def couples_examples(rest_state: nnx.State, train: bool = True) -> bool:
    """True when the model holds BatchNorm statistics and runs in training mode."""
    leaves = jax.tree.leaves(rest_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return train and any(isinstance(v, nnx.BatchStat) for v in leaves)


def _apply(graphdef: nnx.GraphDef, params: nnx.State, rest_state: nnx.State, x: jax.Array,
           train: bool) -> tuple[jax.Array, nnx.Module]:
    # copy=True: fresh Variables, so a training-mode forward (BatchNorm) never writes into the
    # caller's `rest_state` and may run under any trace.
    model = nnx.merge(graphdef, params, rest_state, copy=True)
    (model.train if train else model.eval)()
    return model(x), model


def make_loss_fn(graphdef: nnx.GraphDef, rest_state: nnx.State, task: str, *,
                 train: bool = True, return_state: bool = False) -> Callable:
    """loss_fn(params, batch) -> scalar mean of ℓ_i over the leading axis of batch["x"].

    `rest_state` (from `split_model`) is closed over: build the function inside the jitted
    step when it changes. train: BatchNorm uses batch statistics. return_state: return
    (loss, new_rest_state) for `has_aux=True`, with the BatchNorm running averages updated."""
    _check_task(task)

    def loss_fn(params: nnx.State, batch: Batch):
        outputs, model = _apply(graphdef, params, rest_state, batch["x"], train)
        loss = jnp.mean(per_example_loss(outputs, batch["y"], task))
        return (loss, split_model(model)[2]) if return_state else loss

    vars(loss_fn)["couples_examples"] = couples_examples(rest_state, train)
    return loss_fn


def make_eval_fn(graphdef: nnx.GraphDef, rest_state: nnx.State, task: str) -> Callable:
    """eval_fn(params, batch) -> sums in eval mode, for exact evaluation in chunks:
    {"loss_sum": Σ_i m_i ℓ_i, "count": Σ_i m_i} and, except for regression, "correct_sum":
    Σ_i m_i acc_i; m_i = batch["mask"] (1 real, 0 padding) when given, else 1."""
    _check_task(task)

    def eval_fn(params: nnx.State, batch: Batch) -> dict[str, jax.Array]:
        outputs, _ = _apply(graphdef, params, rest_state, batch["x"], train=False)
        loss_B = per_example_loss(outputs, batch["y"], task)
        real_B = batch["mask"] > 0 if "mask" in batch else jnp.ones(loss_B.shape, bool)
        # where, not a product: padded rows may hold anything, including non-finite losses.
        masked_sum = lambda v_B: jnp.sum(jnp.where(real_B, v_B, 0.0))
        sums = {"loss_sum": masked_sum(loss_B), "count": jnp.sum(real_B.astype(loss_B.dtype))}
        if task != "regression":
            sums["correct_sum"] = masked_sum(per_example_correct(outputs, batch["y"], task))
        return sums

    return eval_fn
