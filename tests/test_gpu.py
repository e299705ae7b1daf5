"""Checks that need a GPU (skipped elsewhere; `benchmarks/accelerator.sh` runs them on one):
the LM's cuDNN attention computes the function its XLA form computes, and the exact
per-example gradient norms (`cbs.stats.ghost`) read a model through it, so the live estimate
stays exact on a GPU.

Tolerances: bfloat16 compute (8 bits of mantissa) in both kernels, which differ in the order
of their sums and in where they round: relative errors of a few 1e-3 per element, so 3e-2 on
logits and 5e-2 on gradient norms (a norm sums many rounded terms), far from the O(1) error
a wrong mask or scale gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cbs import models
from cbs.engine import live_noise
from cbs.stats import ghost

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

T, V = 128, 512


def _lm(attention: str):
    c = models.default_model_config("lm")
    c.update(size="small", compute_dtype="bfloat16", attention=attention)  # D 256, H 4, K 64
    return models.build_model(c, input_shape=(T,), vocab_size=V, rngs=nnx.Rngs(0),
                              verbose=False)


def _batch(b=8, seed=1):
    x = jax.random.randint(jax.random.key(seed), (b, T + 1), 0, V)
    return {"x": x[:, :-1], "y": x[:, 1:]}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_cudnn_attention_equals_xla_attention():
    assert "attention=cudnn" in _lm("auto").description
    ids = _batch()["x"]
    assert _rel(_lm("cudnn")(ids), _lm("xla")(ids)) < 3e-2
    grads = {}
    for kernel in ("cudnn", "xla"):
        graphdef, params, rest = models.split_model(_lm(kernel))
        fn = jax.jit(jax.grad(models.make_loss_fn(graphdef, rest, "lm")))
        grads[kernel] = fn(params, _batch())
    for a, b in zip(jax.tree.leaves(grads["cudnn"]), jax.tree.leaves(grads["xla"]), strict=True):
        assert _rel(a, b) < 5e-2


def test_ghost_norms_read_the_lm_through_cudnn_attention():
    graphdef, params, rest = models.split_model(_lm("cudnn"))
    loss_fn = models.make_loss_fn(graphdef, rest, "lm")
    batch = _batch()
    assert ghost.uncovered_leaves(loss_fn, params, batch) == {}
    fast = jax.jit(lambda p, b: ghost.per_example_grads_info(loss_fn, p, b, method="fast"))
    ref = jax.jit(lambda p, b: ghost.per_example_grads_info(loss_fn, p, b, method="vmap",
                                                              chunk_size=4))
    got, want = fast(params, batch), ref(params, batch)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True):
        assert _rel(a, b) < 5e-2
    stateful = lambda p, s, b: (loss_fn(p, b), s)
    assert live_noise.ghost_unavailable(stateful, params, {}, batch) is None
    assert jnp.isfinite(got[0])
