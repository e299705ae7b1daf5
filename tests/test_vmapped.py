"""Tests of cbs.engine.vmapped: the vmapped step loop equals K separate host loops of the same
step, with the loss EMA of `cbs.runtime.progress.ema_curve` and the last batch loss.

The step is a toy one (gradient descent on (w − x)², w and η in the state) so the reference is
a plain host loop. Tolerance: float32, a few roundings per step over 5 steps: rtol 1e-6.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from cbs.engine.vmapped import run_steps, vmapped_steps
from cbs.runtime import progress

DECAY = 0.5  # EMA decay per step


def _apply(state, inputs, accum_steps):
    """One gradient step on the loss (w − x)²; `accum_steps` scales x so that it is used."""
    w, lr = state["w"], state["lr"]
    x = inputs["x"] * accum_steps
    loss = (w - x) ** 2
    return {"w": w - lr * 2 * (w - x), "lr": lr}, {"train/loss": loss}


def _host(w: float, lr: float, x: float, n: int) -> tuple[float, float, list[float]]:
    losses = []
    w32, lr32, x32 = np.float32(w), np.float32(lr), np.float32(x)
    for _ in range(n):
        losses.append(float((w32 - x32) ** 2))
        w32 = w32 - lr32 * np.float32(2) * (w32 - x32)
    return float(w32), progress.ema_curve(losses, DECAY)[-1], losses[-1]


def test_k_states_with_shared_and_own_inputs_equal_k_host_loops():
    lrs, ws, xs, n = [0.1, 0.2, 0.3], [1.0, -2.0, 0.5], [3.0, 1.0, -1.0], 5
    states = {"w": jnp.asarray(ws, jnp.float32), "lr": jnp.asarray(lrs, jnp.float32)}
    nan = jnp.full((3,), jnp.nan, jnp.float32)
    shared = jax.jit(vmapped_steps(_apply, 2, DECAY))
    own = jax.jit(vmapped_steps(_apply, 2, DECAY, inputs_axes={"x": 0}))
    for fn, x in ((shared, {"x": jnp.float32(xs[0])}), (own, {"x": jnp.asarray(xs)})):
        out, ema, last = fn(states, x, nan, jnp.int32(n))
        for i in range(3):
            xi = xs[0] if fn is shared else xs[i]
            w, want_ema, want_last = _host(ws[i], lrs[i], 2 * xi, n)
            np.testing.assert_allclose([out["w"][i], ema[i], last[i]], [w, want_ema, want_last],
                                       rtol=1e-6)


def test_zero_steps_keep_the_state_and_ema_and_report_no_loss():
    one = jax.jit(run_steps(_apply, 1, DECAY))
    state = {"w": jnp.float32(1.0), "lr": jnp.float32(0.1)}
    out, ema, last = one(state, {"x": jnp.float32(0.0)}, jnp.float32(0.25), jnp.int32(0))
    assert float(out["w"]) == 1.0 and float(ema) == 0.25 and math.isnan(float(last))
    # a second call continues the EMA it is given (the sweep group carries it across chunks)
    _, ema, last = one(state, {"x": jnp.float32(0.0)}, jnp.float32(0.25), jnp.int32(1))
    assert float(last) == 1.0 and float(ema) == DECAY * 0.25 + (1 - DECAY) * 1.0
