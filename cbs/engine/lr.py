"""Learning-rate maths: batch-size coupling, caps and warmup/decay schedules in examples seen.

Letters: e examples seen so far, B the global (logical) batch size, B_0 the base batch size the
base learning rate was tuned at, η the learning rate, η_0 the base (peak) learning rate.

Coupling (Goyal et al. 2017 for SGD, linear; Malladi et al. 2022 and the OLMo batch-size
warmup of "Critical Batch Size Revisited", arXiv:2505.23971, for Adam, square root):
η(B) = η_0 · (B/B_0)^p with p = 0, 1 or 1/2, capped. The multiplier is a pure function of the
current B, so it is applied exactly once per change and never compounds.

Schedules are jnp functions of e, not of steps, so a batch change does not stretch or squeeze
warmup and decay. The train step's rate is `step_rate`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from cbs.runtime import fields

__all__ = [
    "DECAYS", "EXPONENTS", "LR_RULES", "coupled_lr", "coupled_lr_history", "coupling_from_config",
    "learning_rate_shape", "lr_multiplier", "lr_schedule", "lr_schedule_from_config", "step_rate",
    "validate_coupling_config",
]

EXPONENTS = {"none": 0.0, "linear": 1.0, "sqrt": 0.5}  # p of each coupling rule
LR_RULES = tuple(EXPONENTS)  # the learning-rate scaling rules, p = 0, 1, 1/2
DECAYS = ("constant", "cosine", "linear")  # the decays after warmup

# ---------------------------------------------------------------- learning-rate coupling


def lr_multiplier(batch_size: Any, base_batch_size: int, rule: str = "none") -> Any:
    """(B / B_0)^p with p = 0 (none), 1 (linear, SGD) or 1/2 (sqrt, Adam)."""
    if rule not in EXPONENTS:
        raise ValueError(f"rule must be one of {sorted(EXPONENTS)}, got {rule!r}")
    if base_batch_size <= 0:
        raise ValueError("base_batch_size must be > 0")
    return (batch_size / base_batch_size) ** EXPONENTS[rule]


def coupled_lr(base_lr: Any, batch_size: Any, base_batch_size: int, rule: str = "none",
               cap: float | None = None) -> Any:
    """η = min(η_0 · (B/B_0)^p, cap), cap absolute (None: none). Works on floats and inside
    `jit` (η_0 may be traced)."""
    lr = base_lr * lr_multiplier(batch_size, base_batch_size, rule)
    if cap is None:
        return lr
    if isinstance(lr, jax.Array):
        return jnp.minimum(lr, cap)
    return min(lr, cap)


def coupled_lr_history(base_lr: float, batch_sizes: Sequence[int], base_batch_size: int,
                       rule: str = "none", cap: float | None = None) -> np.ndarray:
    """`coupled_lr` at each step of a batch-size history, float64 [num_steps]: each entry
    depends only on that step's B, so a history that returns to B_0 returns to η_0."""
    b = np.asarray(batch_sizes, dtype=np.float64)
    lr = base_lr * lr_multiplier(b, base_batch_size, rule)
    return lr if cap is None else np.minimum(lr, cap)


def coupling_from_config(lr_coupling: ml_collections.ConfigDict, initial_batch_size: int,
                         ) -> tuple[int, str, float | None] | None:
    """(B_0, rule, cap) for `coupled_lr` from `config.batch.lr_coupling`, or None (rule none);
    B_0 = 0 reads as the schedule's first batch size, cap = 0 as none."""
    lc = lr_coupling
    if lc.rule == "none":
        return None
    return (lc.base_batch_size or initial_batch_size, lc.rule, lc.cap or None)


def validate_coupling_config(lr_coupling: Any) -> None:
    """Checks `config.batch.lr_coupling`; raises `fields.ConfigError` naming the bad field."""
    at = "config.batch.lr_coupling"
    fields.choice(lr_coupling, "rule", at, LR_RULES)
    fields.integer(lr_coupling, "base_batch_size", at, minimum=0)
    fields.number(lr_coupling, "cap", at)

# ---------------------------------------------------------------- learning-rate schedules

def lr_schedule(base_lr: float, *, warmup_examples: float = 0.0,
                total_examples: float | None = None, decay: str = "constant",
                final_fraction: float = 0.0) -> Callable[[Any], jax.Array]:
    """η(e): linear warmup 0 → η_0 over `warmup_examples`, then constant, cosine or linear
    decay to final_fraction·η_0 at `total_examples`, held after (jittable). Pass the examples
    seen *including* the current batch, or the first update is zero."""
    if decay not in DECAYS:
        raise ValueError(f"decay must be constant|cosine|linear, got {decay!r}")
    if decay != "constant" and total_examples is None:
        raise ValueError(f"decay={decay!r} needs total_examples")
    if warmup_examples < 0 or (total_examples is not None and total_examples < warmup_examples):
        raise ValueError("need 0 <= warmup_examples <= total_examples")
    if not 0.0 <= final_fraction <= 1.0:
        raise ValueError("final_fraction must be in [0, 1]")
    span = None if total_examples is None else max(total_examples - warmup_examples, 1e-12)

    def fn(examples_seen: Any) -> Any:  # an array (a float when η is constant throughout)
        e = jnp.asarray(examples_seen, dtype=jnp.result_type(float))
        warm: jax.Array | float = (jnp.clip(e / warmup_examples, 0.0, 1.0)
                                   if warmup_examples > 0 else 1.0)
        shape: jax.Array | float
        if decay == "constant":
            shape = 1.0
        else:
            p = jnp.clip((e - warmup_examples) / cast(float, span), 0.0, 1.0)  # a decay has an end
            frac = 0.5 * (1.0 + jnp.cos(jnp.pi * p)) if decay == "cosine" else 1.0 - p
            shape = final_fraction + (1.0 - final_fraction) * frac
        return base_lr * warm * shape

    return fn


def lr_schedule_from_config(config: Any) -> Callable[[Any], jax.Array]:
    """`lr_schedule` from a section or dict of its arguments (base_lr required), for
    hand-written training loops (the engine's is `learning_rate_shape`)."""
    c = fields.as_mapping(config)
    total = c.get("total_examples")
    return lr_schedule(float(fields.lookup(c, "base_lr", "lr_schedule")),
                       warmup_examples=float(fields.lookup(c, "warmup_examples", "", 0.0)),
                       total_examples=None if total is None else float(total),
                       decay=str(fields.lookup(c, "decay", "", "constant")),
                       final_fraction=float(fields.lookup(c, "final_fraction", "", 0.0)))


def learning_rate_shape(config: ml_collections.ConfigDict) -> Callable[[jax.Array], jax.Array]:
    """s(E) = η(E)/η_0 from `config.optim` (`lr_schedule`; the decay ends at
    `optim.total_examples`, or at `train.max_examples` when that is 0). The train step
    multiplies by η_0, which it holds in its state."""
    o = config.optim
    total = o.get("total_examples", 0) or config.train.get("max_examples", 0) or None
    return lr_schedule(1.0,
                       warmup_examples=float(o.get("warmup_examples", 0)),
                       total_examples=None if total is None else float(total),
                       decay=o.get("decay", "constant"),
                       final_fraction=float(o.get("final_fraction", 0.0)))


def step_rate(config: ml_collections.ConfigDict, initial_batch_size: int
              ) -> Callable[[jax.Array, jax.Array, int], jax.Array]:
    """The train step's rate η(η_0, E, B) = coupled_lr(η_0 · s(E), B) (`learning_rate_shape`,
    `coupling_from_config`); jittable."""
    shape = learning_rate_shape(config)
    coupling = coupling_from_config(config.batch.lr_coupling, initial_batch_size)

    def rate(base_lr: jax.Array, examples_seen: jax.Array, batch_size: int) -> jax.Array:
        lr = base_lr * shape(examples_seen)
        if coupling is not None:
            base, rule, cap = coupling
            lr = coupled_lr(lr, batch_size, base, rule, cap)
        return lr

    return rate
