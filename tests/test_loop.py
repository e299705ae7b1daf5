"""Tests of cbs.engine.progress (the divergence rule and loss EMA shared by single runs and
vmapped groups) and of the loop's use of it (a single run that diverges exits naming the
step)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from cbs.engine import config as config_lib
from cbs.engine import mesh as mesh_lib
from cbs.engine import trainer as train
from cbs.engine.progress import DivergenceRule, DivergenceState, ema_update, log_spaced_steps


def test_spike_that_recovers_is_not_a_divergence():
    rule = DivergenceRule(factor=4.0, patience=3)
    state = rule.scan([2.0, 9.0, 9.0, 1.0, 9.0, 9.0, 0.5])
    assert not state.diverged and state.initial == 2.0
    assert rule.first_bad([2.0, 9.0, 9.0, 1.0]) is None


def test_staying_above_is_a_divergence_from_where_it_began():
    rule = DivergenceRule(factor=4.0, patience=3)
    values = [2.0, 1.0, 9.0, 9.5, 10.0, 0.1]
    state = rule.scan(values)
    assert state.diverged and state.diverged_at == 4 and "4 × the initial 2" in state.reason
    assert rule.first_bad(values) == 2


def test_non_finite_diverges_at_once_and_state_round_trips():
    rule = DivergenceRule(factor=0.0, patience=5)
    assert rule.first_bad([2.0, 1e9, math.nan]) == 2  # factor 0: only non-finite counts
    state = rule.scan([2.0, 9.0])
    assert DivergenceState.from_dict(state.to_dict()) == state
    assert DivergenceState.from_dict(None) == DivergenceState()
    with pytest.raises(ValueError, match="divergence_factor"):
        DivergenceRule(factor=0.5)


def test_ema_update_host_and_device():
    assert ema_update(math.nan, 3.0, 0.9) == 3.0
    assert ema_update(1.0, 3.0, 0.5) == 2.0
    np.testing.assert_allclose(np.asarray(jax.jit(lambda e, x: ema_update(e, x, 0.5))(
        np.float32(np.nan), np.float32(3.0))), 3.0)
    assert log_spaced_steps(20, 4) == [0, 1, 3, 7, 20]


def test_adam_at_huge_learning_rate_diverges_with_the_step_named(tmp_path):
    c = config_lib.default_config()
    c.model.hidden_sizes = (16,)
    c.batch.micro_batch = 32
    c.batch.schedule.batch_size = 32
    c.optim.learning_rate = 1e6
    c.train.max_steps = 30
    c.train.log_every = 5
    c.train.progress_bar = False
    c.train.tensorboard = False
    one = mesh_lib.make_mesh(data=1, model=1, devices=jax.devices()[:1])
    with pytest.raises(train.DivergedError, match=r"diverged at step \d+") as err:
        train.run(c, str(tmp_path), mesh=one)
    assert 0 < err.value.step < 30
