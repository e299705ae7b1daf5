"""Tests for cbs.engine.lr: batch-size coupling (rules, caps, applied once per change) and
learning-rate schedules in examples seen."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from cbs.engine import lr

# ---------------------------------------------------------------- LR coupling

def test_coupled_lr_rules_and_cap():
    assert lr.coupled_lr(0.1, 256, 64, "none") == pytest.approx(0.1)
    assert lr.coupled_lr(0.1, 256, 64, "linear") == pytest.approx(0.4)
    assert lr.coupled_lr(0.1, 256, 64, "sqrt") == pytest.approx(0.2)
    assert lr.coupled_lr(0.1, 1024, 64, "linear", cap=0.5) == pytest.approx(0.5)
    assert lr.coupled_lr(0.1, 16, 64, "sqrt") == pytest.approx(0.05)
    with pytest.raises(ValueError, match="rule"):
        lr.coupled_lr(0.1, 16, 64, "cubic")


def test_coupling_applied_exactly_once_per_change():
    sizes = [64] * 3 + [128] * 4 + [256] * 3 + [128] * 2 + [64] * 2
    lrs = lr.coupled_lr_history(1e-3, sizes, 64, "sqrt")
    expected = 1e-3 * np.sqrt(np.asarray(sizes) / 64)
    np.testing.assert_allclose(lrs, expected, rtol=1e-15)
    # The multiplier changes exactly at the batch changes, by the ratio of the change.
    changes = np.flatnonzero(np.diff(sizes)) + 1
    assert np.array_equal(np.flatnonzero(np.diff(lrs)) + 1, changes)
    np.testing.assert_allclose(lrs[changes] / lrs[changes - 1],
                               np.sqrt(np.asarray(sizes)[changes] / np.asarray(sizes)[changes - 1]))
    # Holding a batch size holds the LR (a compounding rule would give 2, 4, 8 x).
    linear = lr.coupled_lr_history(1.0, [64, 128, 128, 128], 64, "linear")
    np.testing.assert_array_equal(linear, [1.0, 2.0, 2.0, 2.0])
    assert lrs[-1] == 1e-3  # a round trip returns to the base LR exactly


def test_coupled_lr_inside_jit_with_schedule():
    lr_fn = lr.lr_schedule(1e-2, warmup_examples=100, total_examples=1000, decay="linear")

    @jax.jit
    def lr_at(e):
        return lr.coupled_lr(lr_fn(e), 256, 64, "linear", cap=3e-2)

    np.testing.assert_allclose(float(lr_at(50.0)), 2e-2, rtol=1e-6)
    np.testing.assert_allclose(float(lr_at(100.0)), 3e-2, rtol=1e-6)  # 4e-2 capped
    np.testing.assert_allclose(float(lr_at(550.0)), 2e-2, rtol=1e-6)


# ---------------------------------------------------------------- LR schedules

@pytest.mark.usefixtures("x64")
def test_lr_schedule_key_points():
    base, w, total = 0.1, 1000.0, 11000.0
    cos = lr.lr_schedule(base, warmup_examples=w, total_examples=total, decay="cosine",
                         final_fraction=0.1)
    lin = lr.lr_schedule(base, warmup_examples=w, total_examples=total, decay="linear")
    const = lr.lr_schedule(base, warmup_examples=w)
    for f in (cos, lin, const):
        assert float(f(0.0)) == 0.0
        np.testing.assert_allclose(float(f(500.0)), 0.05, rtol=1e-12)
        np.testing.assert_allclose(float(f(w)), base, rtol=1e-12)
    np.testing.assert_allclose(float(cos(6000.0)), base * (0.1 + 0.9 * 0.5), rtol=1e-12)
    np.testing.assert_allclose(float(cos(3500.0)),
                               base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))), rtol=1e-12)
    np.testing.assert_allclose(float(cos(total)), 0.01, rtol=1e-12)
    np.testing.assert_allclose(float(cos(5 * total)), 0.01, rtol=1e-12)
    np.testing.assert_allclose(float(lin(6000.0)), 0.05, rtol=1e-12)
    assert float(lin(total)) == 0.0
    np.testing.assert_allclose(float(const(1e9)), base, rtol=1e-12)
    # Vectorised over an array of examples, and the same under jit.
    es = jnp.linspace(0.0, total, 23)
    np.testing.assert_allclose(jax.jit(cos)(es), [float(cos(e)) for e in es], rtol=1e-12)


def test_lr_schedule_is_in_examples_not_steps():
    # Two batch histories that reach the same examples give the same LR there.
    f = lr.lr_schedule(1.0, warmup_examples=256, total_examples=4096, decay="cosine")
    e_small = np.cumsum([32] * 64)  # 64 steps of 32
    e_ramp = np.cumsum([32] * 16 + [64] * 8 + [128] * 8)  # 32 steps, ramped
    assert e_small[-1] == e_ramp[-1] == 2048
    assert float(f(e_small[-1])) == float(f(e_ramp[-1]))


def test_lr_schedule_from_config_and_validation():
    cfg = ml_collections.ConfigDict({"base_lr": 0.5, "warmup_examples": 10,
                                     "total_examples": 110, "decay": "linear"})
    f = lr.lr_schedule_from_config(cfg)
    np.testing.assert_allclose(float(f(60.0)), 0.25, rtol=1e-6)
    with pytest.raises(ValueError, match="total_examples"):
        lr.lr_schedule(0.1, decay="cosine")
    with pytest.raises(ValueError, match="base_lr"):
        lr.lr_schedule_from_config({"decay": "constant"})


def test_coupling_from_config():
    c = ml_collections.ConfigDict({"rule": "none", "base_batch_size": 0, "cap": 0.0})
    assert lr.coupling_from_config(c, 64) is None
    c.rule = "sqrt"
    assert lr.coupling_from_config(c, 64) == (64, "sqrt", None)  # B_0: the first batch size
    c.base_batch_size, c.cap = 32, 0.5
    assert lr.coupling_from_config(c, 64) == (32, "sqrt", 0.5)


def test_learning_rate_shape_ends_its_decay_at_max_examples():
    c = ml_collections.ConfigDict({"optim": {"warmup_examples": 10, "decay": "linear",
                                             "total_examples": 0, "final_fraction": 0.0},
                                   "train": {"max_examples": 110}})
    s = lr.learning_rate_shape(c)
    np.testing.assert_allclose([float(s(e)) for e in (5.0, 10.0, 60.0, 110.0)],
                               [0.5, 1.0, 0.5, 0.0], atol=1e-7)
