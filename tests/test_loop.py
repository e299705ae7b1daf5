"""Tests of cbs.runtime.progress (the divergence rule and loss EMA shared by single runs and
vmapped groups) and of cbs.engine.loop: its order of events, budgets, stopping, divergence and
resume with a scripted driver, and a single run that diverges exits naming the step."""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbs.engine import config as config_lib
from cbs.engine import loop, schedules, trainer
from cbs.engine.driver import Deferred
from cbs.results import files, records
from cbs.runtime import mesh as mesh_lib
from cbs.runtime.progress import (
    DivergenceRule,
    DivergenceState,
    ema_curve,
    ema_update,
    log_spaced_steps,
)


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
    ema = math.nan
    for x in (4.0, 2.0, 8.0):
        ema = ema_update(ema, x, 0.75)
    assert ema == pytest.approx(0.75 * (0.75 * 4.0 + 0.25 * 2.0) + 0.25 * 8.0)
    np.testing.assert_array_equal(ema_update(np.array([np.nan, 1.0]), np.array([3.0, 3.0]), 0.5),
                                  [3.0, 2.0])
    assert ema_curve([4.0, 2.0, 8.0], 0.75) == [4.0, 3.5, ema]
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
    with pytest.raises(loop.DivergedError, match=r"diverged at step \d+") as err:
        trainer.run(c, str(tmp_path), mesh=one)
    assert 0 < err.value.step < 30


# ---------------------------------------------------------------------- the loop, unit tests
# `Loop` drives any `cbs.engine.loop.Driver`: here a scripted host-side one (no model), so
# its order of events, stopping and resume are tested on their own.


@dataclasses.dataclass(frozen=True)
class _CountState:
    batch_size: int
    seen: tuple[float, ...] = ()

    def to_dict(self):
        return {"batch_size": self.batch_size, "seen": list(self.seen)}


class _Doubling:
    """A schedule outside the registry that observes B_simple: B doubles at each observation
    (the loop must feed it through the protocol alone)."""

    observes = "b_simple"

    def init(self):
        return _CountState(2)

    def update(self, state, noise_scale, examples_seen):
        return _CountState(state.batch_size * 2, (*state.seen, float(noise_scale)))

    def state_from_dict(self, raw):
        return self.init() if raw is None else _CountState(raw["batch_size"], tuple(raw["seen"]))

    def batch_size_at(self, examples_seen, state=None):
        return state.batch_size

    def planning_batch_size(self, examples_seen):
        return 2

    def batch_sizes(self):
        return (2, 4, 8, 16, 32, 64)


class _Scripted:
    """A driver whose state is a step counter and whose batch loss at step t is losses[t]
    (1.0 past the end); `stride` steps per dispatch (a group-like driver has no train
    records: it reports only evaluations)."""

    def __init__(self, config, workdir, losses=(), *, schedule=None, stride=1,
                 start_position=(0, 0)):
        self.config, self.workdir, self.losses, self.stride = config, workdir, losses, stride
        self.start_position = start_position
        self.schedule = schedule or schedules.Constant(4)
        self.evaluated: list[int] = []

    def _fresh(self):
        return {"t": jnp.zeros((), jnp.int32)}

    def start(self, restore):
        if restore is not None:
            return restore(jax.eval_shape(self._fresh))
        step, seen = self.start_position
        return self._fresh(), {"step": step, "examples_seen": seen}

    def advance(self, state, step, examples_seen, batch_size):
        n = self.stride
        state = {"t": state["t"] + n}
        if n > 1:
            return state, n, None
        loss = self.losses[step] if step < len(self.losses) else 1.0
        values = {"train/loss": np.float32(loss)}
        return state, 1, Deferred(values, lambda v: [
            {"data/batch_size": batch_size} | {k: float(x) for k, x in v.items()}])

    def checkpoint_due(self, step):
        return step % self.config.train.checkpoint_every == 0

    def evaluation_due(self, step):
        return bool(self.config.eval.every and step % self.config.eval.every == 0)

    def evaluate_at(self, state, step):
        self.evaluated.append(step)
        return Deferred(state["t"], lambda t: [{"eval/loss": 1.0 / (1.0 + float(t))}])


def _loop(driver, **kwargs):
    """The loop of a scripted driver: its own points; a strided one reads each evaluation."""
    return loop.Loop(driver, points=driver, read_each_evaluation=driver.stride > 1, **kwargs)


def _loop_config(**train):
    c = config_lib.default_config()
    c.train.update(dict(progress_bar=False, tensorboard=False, log_every=2,
                        checkpoint_every=1000, divergence_factor=4.0, divergence_patience=2))
    c.train.update(train)
    c.eval.every = 3
    return c


def _records(workdir):
    return records.read_records(os.path.join(workdir, files.METRICS_FILE))


def test_loop_runs_to_the_step_budget_with_evaluations_on_schedule(tmp_path):
    d = str(tmp_path)
    drv = _Scripted(_loop_config(max_steps=7), d)
    summary = _loop(drv).run()
    assert summary["status"] == "finished" and summary["step"] == 7
    recs = _records(d)
    assert [r["step"] for r in recs if r["kind"] == "train"] == list(range(7))
    assert [r["step"] for r in recs if r["kind"] == "eval"] == [0, 3, 6, 7]
    assert [r["data/examples_seen"] for r in recs if r["kind"] == "train"] == list(range(0, 28, 4))
    assert summary["checkpoint_step"] == 7


def test_a_state_that_starts_later_runs_from_its_position_to_the_same_budget(tmp_path):
    """A driver whose fresh state is at step 5 with 20 examples seen (a branch from its
    point): the loop's counters start there and `train.max_steps` counts from step 0."""
    d = str(tmp_path)
    summary = _loop(_Scripted(_loop_config(max_steps=7), d, start_position=(5, 20))).run()
    assert (summary["step"], summary["examples_seen"]) == (7, 28)
    recs = _records(d)
    assert [r["step"] for r in recs if r["kind"] == "train"] == [5, 6]
    assert [r["data/examples_seen"] for r in recs if r["kind"] == "train"] == [20, 24]
    assert [r["step"] for r in recs if r["kind"] == "eval"] == [6, 7]


def test_loop_stops_on_the_example_budget(tmp_path):
    c = _loop_config(max_steps=0, max_examples=10)
    summary = _loop(_Scripted(c, str(tmp_path))).run()
    assert summary["status"] == "finished"
    assert (summary["step"], summary["examples_seen"]) == (3, 12)  # B = 4: 12 ≥ 10


def test_stop_fn_ends_the_run_as_stopped_with_a_final_evaluation(tmp_path):
    d = str(tmp_path)
    drv = _Scripted(_loop_config(max_steps=50), d)
    summary = _loop(drv, stop_fn=lambda step, rec: step == 4).run()
    assert summary["status"] == "stopped"
    # read every log_every = 2 steps, all but the newest: step 4 is read at t = 6
    assert summary["step"] == 6 and drv.evaluated == [0, 3, 6]
    assert summary["checkpoint_step"] == 6


def test_divergence_after_patience_is_raised_with_its_step(tmp_path):
    d = str(tmp_path)
    losses = [1.0, 1.0, 9.0, 1.0, 9.0, 9.0, 9.0]  # factor 4, patience 2: diverged at step 5
    with pytest.raises(loop.DivergedError, match="diverged at step 5") as err:
        _loop(_Scripted(_loop_config(max_steps=20), d, losses)).run()
    assert err.value.step == 5
    status = records.read_json(os.path.join(d, files.STATUS_FILE))
    assert status["status"] == "diverged"
    assert max(r["step"] for r in _records(d)) == 5  # the bad step is recorded, nothing after


def test_non_finite_loss_diverges_at_once_without_raising_when_asked(tmp_path):
    summary = _loop(_Scripted(_loop_config(max_steps=20), str(tmp_path),
                                  [1.0, 1.0, math.nan])).run(raise_on_divergence=False)
    assert summary["status"] == "diverged" and summary["step"] == 2
    assert "non-finite loss" in summary["message"]


def test_a_multi_step_driver_stops_at_the_evaluation_that_asked(tmp_path):
    """A group-like driver (5 steps per dispatch, no train records) reads each evaluation at
    once, so a stop takes effect before the next dispatch."""
    c = _loop_config(max_steps=100)
    c.eval.every = 5
    drv = _Scripted(c, str(tmp_path), stride=5)
    summary = _loop(drv, stop_fn=lambda step, rec: rec["eval/loss"] < 0.08).run()
    assert summary["status"] == "stopped" and summary["step"] == 15  # 1/16 < 0.08 < 1/11
    assert drv.evaluated == [0, 5, 10, 15]
    assert all(r["kind"] == "eval" for r in _records(str(tmp_path)))


def test_an_unregistered_observing_schedule_is_fed_and_resumed_through_its_protocol(
        tmp_path, monkeypatch):
    """The loop reads the state's smoothed noise scale (here 100 + t) every `adapt_every`
    steps and feeds the schedule; a resumed run continues from the checkpoint's state."""
    def scripted_noise_scale(state, name):
        assert name == "b_simple"
        return 100.0 + float(state["t"])

    monkeypatch.setattr(loop, "noise_scale", scripted_noise_scale)
    d = str(tmp_path)
    c = _loop_config(max_steps=4, log_every=1, checkpoint_every=2)
    c.batch.adapt_every = 2
    first = _loop(_Scripted(c, d, schedule=_Doubling()))
    first.run()
    assert first.sched_state == _CountState(4, (102.0,))  # observed at t = 2 (not at t = 0)
    c.train.max_steps = 8  # continue the same run: the schedule state comes from the checkpoint
    second = _loop(_Scripted(c, d, schedule=_Doubling()))
    second.run()
    assert second.sched_state == _CountState(16, (102.0, 104.0, 106.0))
    sizes = [r["data/batch_size"] for r in _records(d) if r["kind"] == "train"]
    assert sizes == [2, 2, 4, 4, 8, 8, 16, 16]


@pytest.mark.parametrize("status", ["running", "preempted", "finished", "stopped", "diverged"])
def test_ended_run_is_the_one_check_of_a_finished_run(tmp_path, status):
    """Trainer.run, a sweep group and a branch study's reference run all ask `ended_run`:
    an ended run with the same config returns its summary (a diverged one raises again
    unless asked not to); a run that can resume, or another config, returns None."""
    c = config_lib.default_config()
    summary = {"status": status, "config_hash": loop.config_hash(c), "message": "why"}
    records.write_json_atomic(os.path.join(tmp_path, files.STATUS_FILE), summary)
    if status == "diverged":
        with pytest.raises(loop.DivergedError, match="why"):
            loop.ended_run(str(tmp_path), c)
    ended = status in loop.ENDED
    assert (loop.ended_run(str(tmp_path), c, raise_on_divergence=False) == summary) == ended
    c.seed += 1
    assert loop.ended_run(str(tmp_path), c) is None
    assert loop.ended_run(str(tmp_path / "nothing"), c) is None
