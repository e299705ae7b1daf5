"""Many steps of many training states as one device program: the vmapped step loop.

Runs that differ only in values held by the state (the peak learning rate η_0 of a sweep
group's trials) or in a value of the step's inputs (the stream seed of a branch's seeds) share
one compiled program: a `jax.lax.fori_loop` of `TrainStep.apply` whose length is a traced
value (no recompilation per length), vmapped over a leading axis K of the states (the trial
groups of `cbs.sweeps.groups`, the branched runs of `cbs.sweeps.branches`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from cbs.runtime.progress import ema_update

__all__ = ["run_steps", "vmapped_steps"]

# apply(state, inputs, accum_steps) -> (state, metrics): `cbs.engine.step.TrainStep.apply`
_Apply = Callable[[Any, Any, int], tuple[Any, dict[str, jax.Array]]]


def run_steps(apply: _Apply, accum_steps: int, ema_decay: float) -> Callable:
    """one(state, inputs, ema, num_steps) -> (state, ema, last_loss): `num_steps` (traced)
    applications of `apply(state, inputs, accum_steps)`; `ema` is the EMA of the batch loss
    (`cbs.runtime.progress.ema_update`; NaN: no loss seen yet) before and after, `last_loss`
    the last step's batch loss (NaN after no step), both of the EMA's dtype."""

    def one(state: Any, inputs: Any, ema: jax.Array, num_steps: jax.Array
            ) -> tuple[Any, jax.Array, jax.Array]:
        def body(_: jax.Array, carry: tuple[Any, jax.Array, jax.Array]
                 ) -> tuple[Any, jax.Array, jax.Array]:
            s, e, _ = carry
            s, m = apply(s, inputs, accum_steps)
            loss = m["train/loss"]
            return s, ema_update(e, loss, ema_decay), loss

        last = jnp.full_like(ema, jnp.nan)
        return jax.lax.fori_loop(0, num_steps, body, (state, ema, last))

    return one


def vmapped_steps(apply: _Apply, accum_steps: int, ema_decay: float,
                  inputs_axes: Any = None) -> Callable:
    """`run_steps` over K states, (states[K], inputs, ema[K], num_steps) -> (states[K],
    ema[K], last_loss[K]), not jitted (the caller jits it with its own shardings).
    inputs_axes: vmap axes of the inputs: None (shared), 0 (one each), or a pytree of these
    matching the inputs (e.g. arrays shared, a seed per state)."""
    return jax.vmap(run_steps(apply, accum_steps, ema_decay), in_axes=(0, inputs_axes, 0, None))
