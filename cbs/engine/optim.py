"""Optimizers from a config: the update direction from optax, the step size from examples seen.

The optimizer is split in two so that batch-size changes never distort the schedule:

    direction:  u_t = T(g_t)      an optax transformation without a learning rate
                                  (clipping, momentum or Adam moments, weight decay);
    step:       θ_{t+1} = θ_t − η(E_t)·c(B_t)·u_t

where E_t is the number of examples seen before step t, η(E) the warmup/decay schedule in
examples (`cbs.engine.lr.learning_rate_shape`) and c(B) the batch-size coupling factor
(`cbs.engine.lr.coupled_lr`; 1 unless the config couples the learning rate to B). For a
constant η this is exactly `optax.sgd / optax.adam / optax.adamw` (optax multiplies by −η in
its last stage; we do the same outside), which the tests check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from cbs.engine.lr import DECAYS
from cbs.runtime import fields

__all__ = ["make_direction", "validate_config"]

_OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
_WEIGHT_DECAY_MASKS = ("all", "matrices")


def validate_config(optim_config: ml_collections.ConfigDict, *, max_examples: int = 0) -> None:
    """Checks `config.optim` (a decay ends at `max_examples` when `total_examples` is 0);
    raises `fields.ConfigError` naming the first bad field."""
    c, at = optim_config, "config.optim"
    fields.choice(c, "name", at, _OPTIMIZERS)
    fields.number(c, "learning_rate", at, strict=True)
    for name in ("momentum", "b1", "b2", "weight_decay", "clip_norm", "final_fraction"):
        fields.number(c, name, at)
    fields.number(c, "eps", at, strict=True)
    fields.choice(c, "weight_decay_mask", at, _WEIGHT_DECAY_MASKS)
    fields.choice(c, "decay", at, DECAYS)
    fields.integer(c, "warmup_examples", at, minimum=0)
    total = fields.integer(c, "total_examples", at, minimum=0)
    if c.decay != "constant" and not (total or max_examples):
        raise fields.ConfigError(f"{at}.total_examples: decay={c.decay!r} needs it (or "
                                 "train.max_examples)")


def make_direction(optim: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """The optax transformation that maps a mean gradient to an update direction u (no η).

    sgd: u = g (+ wd·θ, coupled L2); momentum: heavy-ball (or Nesterov) trace of that;
    adam: Adam direction of (g + wd·θ) (coupled L2, as `optax.adam` + `add_decayed_weights`
    before it); adamw: Adam direction + wd·θ (decoupled, exactly `optax.adamw`).
    Gradient clipping by global norm (`clip_norm > 0`) comes first in every case.
    """
    name = optim.name
    if name not in _OPTIMIZERS:
        raise fields.ConfigError(f"config.optim.name: unknown optimizer {name!r}; known: "
                                 f"{_OPTIMIZERS}")
    wd = float(optim.get("weight_decay", 0.0))
    mask = None if optim.get("weight_decay_mask", "matrices") == "all" else (  # "matrices":
        lambda params: jax.tree.map(lambda p: jnp.ndim(p) >= 2, params))  # not biases, scales
    stages = []
    if optim.get("clip_norm", 0.0) and optim.clip_norm > 0:
        stages.append(optax.clip_by_global_norm(float(optim.clip_norm)))
    if name in ("sgd", "momentum", "adam") and wd > 0:
        stages.append(optax.add_decayed_weights(wd, mask))
    if name == "momentum":
        stages.append(optax.trace(decay=float(optim.get("momentum", 0.9)),
                                  nesterov=bool(optim.get("nesterov", False))))
    elif name in ("adam", "adamw"):
        stages.append(optax.scale_by_adam(b1=float(optim.get("b1", 0.9)),
                                          b2=float(optim.get("b2", 0.999)),
                                          eps=float(optim.get("eps", 1e-8))))
    if name == "adamw" and wd > 0:
        stages.append(optax.add_decayed_weights(wd, mask))
    return optax.chain(*stages) if stages else optax.identity()
