"""Tests for cbs.engine.schedules: documented sizes, adaptive hysteresis, token schedules."""

import dataclasses
import json
import math

import ml_collections
import numpy as np
import pytest

from cbs.engine import config as config_lib
from cbs.engine import schedules as sch
from cbs.engine.adaptive import Adaptive, AdaptiveState
from cbs.engine.lr import lr_schedule
from cbs.runtime.fields import ConfigError

MI = 2 ** 20


def test_constant():
    s = sch.Constant(64)
    assert [s.batch_size_at(e) for e in (0, 10, 1e12)] == [64, 64, 64]


def test_step_thresholds_inclusive():
    s = sch.Step(((0, 8), (100, 16), (1000, 64)))
    assert [s.batch_size_at(e) for e in (0, 99, 100, 999, 1000, 10**9)] == [8, 8, 16, 16, 64, 64]


def test_step_rejects_bad_definitions():
    with pytest.raises(ValueError, match="start with"):
        sch.Step(((10, 8),))
    with pytest.raises(ValueError, match="increase"):
        sch.Step(((0, 8), (100, 16), (100, 32)))


def test_llama3_full_scale():
    s = sch.llama3_schedule()
    assert s.batch_size_at(0) == 4 * MI == 1024 * 4096
    assert s.batch_size_at(251_999_999) == 4 * MI
    assert s.batch_size_at(252_000_000) == 8 * MI == 1024 * 8192
    assert s.batch_size_at(1_000_000_000_000) == 8 * MI
    assert s.batch_size_at(2_869_999_999_999) == 8 * MI
    assert s.batch_size_at(2_870_000_000_000) == 16 * MI == 2048 * 8192
    assert s.batch_size_at(15_600_000_000_000) == 16 * MI
    in_seqs = sch.llama3_schedule(tokens_per_unit=8192)
    assert [in_seqs.batch_size_at(e) for e in (0, 30_762, 350_341_797)] == [512, 1024, 2048]


def test_llama3_trace_steps_and_switch_points():
    # Walk the first 0.3T tokens: the switch happens on the first step starting at >= 252M.
    starts, sizes = sch.batch_size_trace(sch.llama3_schedule(), 300_000_000)
    first_8m = int(np.argmax(sizes == 8 * MI))
    assert starts[first_8m] >= 252_000_000 > starts[first_8m - 1]
    assert first_8m == math.ceil(252_000_000 / (4 * MI))  # 61 steps at 4M tokens
    assert set(sizes.tolist()) == {4 * MI, 8 * MI}


def test_deepseek_v3_full_scale_sequences():
    s = sch.deepseek_v3_schedule()
    over = 469e9 / 4096  # sequences
    assert s.batch_size_at(0) == 3072
    assert s.batch_size_at(over / 2) == (3072 + 15360) // 2 == 9216
    assert s.batch_size_at(over / 4) == 6144
    assert s.batch_size_at(over) == 15360
    assert s.batch_size_at(14.8e12 / 4096) == 15360
    sizes = [s.batch_size_at(e) for e in np.linspace(0, 1.2 * over, 101)]
    assert all(b <= c for b, c in zip(sizes, sizes[1:], strict=False))


def test_deepseek_v3_full_scale_tokens_and_multiple():
    s = sch.deepseek_v3_schedule(unit="tokens")
    assert s.batch_size_at(0) == 3072 * 4096
    assert s.batch_size_at(234.5e9) == 9216 * 4096
    assert s.batch_size_at(469e9) == 15360 * 4096
    coarse = sch.deepseek_v3_schedule(multiple=256)
    for e in np.linspace(0, 469e9 / 4096, 37):
        assert coarse.batch_size_at(e) % 256 == 0


def test_linear_rounds_to_multiple():
    s = sch.Linear(start=16, end=128, over=1000, multiple=16)
    # raw sizes 16 + 112·f; nearest multiple of 16.
    assert [s.batch_size_at(e) for e in (0, 70, 72, 500, 1000, 5000)] == [16, 16, 32, 80, 128, 128]
    with pytest.raises(ValueError, match="multiple"):
        sch.Linear(start=10, end=128, over=1000, multiple=16)


def test_scaled_shapes():
    small = sch.llama3_schedule().scaled(examples=1e-6, batch=1 / MI)
    assert small.steps == ((0, 4), (252, 8), (2_870_000, 16))
    ds = sch.deepseek_v3_schedule().scaled(examples=1e-5, batch=1 / 96, multiple=8)
    assert (ds.start, ds.end, ds.multiple) == (32, 160, 8)


def test_from_config_dispatch_and_errors():
    cfg = ml_collections.ConfigDict({"kind": "step", "steps": [(0, 8), (64, 16)]})
    assert sch.batch_schedule_from_config(cfg).batch_size_at(64) == 16
    lin = sch.batch_schedule_from_config({"kind": "linear", "start": 8, "end": 32, "over": 10})
    assert lin == sch.Linear(8, 32, 10.0, 1)
    ad = sch.batch_schedule_from_config({"kind": "adaptive", "min_batch": 8, "max_batch": 256})
    assert ad.init().batch_size == 8
    with pytest.raises(ValueError, match="'batch_size'"):
        sch.batch_schedule_from_config({"kind": "constant"})
    with pytest.raises(ValueError, match="kind"):
        sch.batch_schedule_from_config({"kind": "cubic"})
    with pytest.raises(ValueError, match="unknown adaptive fields"):
        sch.batch_schedule_from_config({"kind": "adaptive", "min_batch": 8, "max_batch": 9,
                                        "patiance": 3})


def test_static_schedules_accept_state_protocol():
    s = sch.Constant(32)
    state = s.update(s.init(), 123.0, 10)
    assert state is None and s.batch_size_at(10, state) == 32


# ---------------------------------------------------------------- adaptive

def _run(schedule, signal, every=64):
    state, sizes = schedule.init(), []
    for t, x in enumerate(signal):
        state = schedule.update(state, x, t * every)
        sizes.append(state.batch_size)
    return state, np.asarray(sizes)


def _naive(signal, rungs):
    return np.asarray([min(rungs, key=lambda r: abs(math.log(r / x))) for x in signal])


def test_adaptive_dead_zone_never_moves():
    # Alternates across the midpoint 90.5 of rungs 64 and 128 on every update: nearest-rung
    # rounding flips every time; inside the band B·[1/band, band] nothing may move.
    s = Adaptive(min_batch=16, max_batch=256, initial=64, patience=1)
    signal = [80.0, 100.0] * 200 + [64 * 1.68, 64 / 1.68] * 50
    assert np.count_nonzero(np.diff(_naive(signal, s.rungs))) >= 0.99 * len(signal)
    state, sizes = _run(s, signal)
    assert state.num_changes == 0 and set(sizes.tolist()) == {64}


def test_adaptive_hysteresis_prevents_oscillation_on_noisy_signal():
    # Worst case: the true noise scale sits at the geometric midpoint between rungs 64 and
    # 128, seen through i.i.d. log-normal noise of 10 %.
    rng = np.random.default_rng(0)
    signal = math.sqrt(64 * 128) * np.exp(0.1 * rng.standard_normal(4000))
    assert np.count_nonzero(np.diff(_naive(signal, (16, 32, 64, 128, 256)))) > 1000
    s = Adaptive(min_batch=16, max_batch=256, initial=64)  # defaults: band 1.68, patience 3
    state, sizes = _run(s, signal)
    assert state.num_changes <= 2 and set(sizes.tolist()) <= {64, 128}
    # With 25 % noise and more patience it still does not flip-flop.
    signal = math.sqrt(64 * 128) * np.exp(0.25 * rng.standard_normal(4000))
    state, sizes = _run(Adaptive(min_batch=16, max_batch=256, initial=64, patience=8),
                        signal)
    assert state.num_changes <= 2
    # Every change is preceded by at least `patience` updates at the old size.
    state, sizes = _run(Adaptive(min_batch=16, max_batch=256, initial=64, patience=3),
                        signal)
    dwell = np.diff(np.flatnonzero(np.diff(sizes)))
    assert state.num_changes > 2 and dwell.min() >= 3


def test_adaptive_follows_a_growing_signal_on_allowed_rungs_within_limits():
    s = Adaptive(min_batch=8, max_batch=512, factor=2, k=2.0, patience=3, multiple=8)
    rng = np.random.default_rng(1)
    signal = np.geomspace(1.0, 2000.0, 600) * np.exp(0.2 * rng.standard_normal(600))
    state, sizes = _run(s, signal)
    assert sizes[0] == 8 and sizes[-1] == 512
    assert set(sizes.tolist()) <= set(s.rungs) == {8, 16, 32, 64, 128, 256, 512}
    ratios = sizes[1:][np.diff(sizes) != 0] / sizes[:-1][np.diff(sizes) != 0]
    assert np.all(np.isin(ratios, [2.0, 4.0, 8.0, 0.5, 0.25]))  # powers of 2 only
    assert np.all(np.diff(sizes) >= 0)  # never moved down on an upward trend
    # Way above max / below min: clipped, never outside [min, max].
    state, sizes = _run(s, [1e9] * 10 + [1e-9] * 30)
    assert sizes.max() == 512 and sizes[-1] == 8 and sizes.min() == 8


def test_adaptive_patience_and_trusted_target():
    s = Adaptive(min_batch=16, max_batch=1024, initial=16, patience=3)
    state = s.init()
    for i, x in enumerate([1000.0, 1000.0]):
        state = s.update(state, x, i)
        assert state.batch_size == 16 and state.streak == i + 1
    state = s.update(state, 70.0, 2)  # third vote, but the weakest: move to nearest of 70
    assert state.batch_size == 64 and state.num_changes == 1 and state.streak == 0
    assert state.last_change_at == 2.0
    # An interrupted streak restarts.
    state = s.update(state, 500.0, 3)
    state = s.update(state, 80.0, 4)  # inside the band of 64: streak resets
    state = s.update(state, 500.0, 5)
    state = s.update(state, 500.0, 6)
    assert state.batch_size == 64 and state.streak == 2


def test_adaptive_ignores_nan_and_state_is_json():
    s = Adaptive(min_batch=8, max_batch=64, patience=2)
    state = s.update(s.init(), float("nan"), 0)
    assert state.batch_size == 8 and state.num_updates == 1 and state.streak == 0
    state = s.update(state, 40.0, 8)
    blob = json.dumps(state.to_dict())
    restored = AdaptiveState.from_dict(json.loads(blob))
    assert restored == state
    assert s.update(restored, 40.0, 16) == s.update(state, 40.0, 16)
    assert s.update(restored, 40.0, 16).batch_size == 32


def test_adaptive_rejects_band_that_allows_oscillation():
    with pytest.raises(ValueError, match="sqrt"):
        Adaptive(min_batch=8, max_batch=64, factor=2, band=1.4)
    with pytest.raises(ValueError, match="ladder"):
        Adaptive(min_batch=8, max_batch=64, initial=24)


def test_a_registered_schedule_is_built_from_config_and_validated():
    @dataclasses.dataclass(frozen=True)
    class Doubling(sch._Static):
        """B doubles every `every` examples, from `start` up to `cap`."""

        start: int
        every: int
        cap: int

        def batch_size_at(self, examples_seen, state=None):
            return min(self.cap, self.start * 2 ** int(examples_seen // self.every))

        def batch_sizes(self):
            sizes, b = [], self.start
            while b <= self.cap:
                sizes.append(b)
                b *= 2
            return tuple(sizes)

        @classmethod
        def from_config(cls, config):
            return cls(**{k: v for k, v in dict(config).items() if k != "kind"})

    sch.register("_doubling", Doubling)
    try:
        spec = {"kind": "_doubling", "start": 16, "every": 100, "cap": 64}
        schedule = sch.batch_schedule_from_config(spec)
        assert [schedule.batch_size_at(e) for e in (0, 99, 100, 250, 10_000)] == [
            16, 16, 32, 64, 64]
        assert schedule.observes is None and schedule.init() is None
        c = config_lib.default_config()
        c.batch.micro_batch = 16
        c.batch.schedule = ml_collections.ConfigDict(spec)
        assert config_lib.batch_sizes(c) == (16, 32, 64)
        config_lib.validate(c, data_replicas=1)
        c.batch.micro_batch = 32  # 16 is no multiple of 32: the validation names the field
        with pytest.raises(ConfigError, match="config.batch.schedule"):
            config_lib.validate(c, data_replicas=1)
        with pytest.raises(ValueError, match="already registered"):
            sch.register("_doubling", Doubling)
    finally:
        sch._SCHEDULES.pop("_doubling")


def test_token_schedules_and_counter_at_three_trillion_tokens():
    """At 3·10¹² tokens (past int32 by 1400×): Llama 3's batch is 16M tokens = 2048 sequences
    of 8192, in tokens and in sequences; the exact device counter holds the position and the
    cosine learning rate read there equals the float64 closed form."""
    from cbs.engine import state as counts

    tokens, t = 3 * 10**12, 8192
    assert sch.llama3_schedule().batch_size_at(tokens) == 16 * MI
    seqs = sch.in_sequences(sch.llama3_schedule(), t)
    assert seqs == sch.llama3_schedule(tokens_per_unit=t)
    assert seqs.batch_size_at(tokens // t) == 2048 and seqs.batch_size_at(0) == 512
    switch = -(-2_870_000_000_000 // t)  # the first sequence count at >= 2.87e12 tokens
    assert seqs.batch_size_at(switch - 1) == 1024 and seqs.batch_size_at(switch) == 2048
    assert (switch - 1) * t < 2_870_000_000_000 <= switch * t
    assert sch.in_sequences(sch.Constant(4 * MI), 4096) == sch.Constant(1024)
    with pytest.raises(ValueError, match="seq_len"):
        sch.in_sequences(sch.Constant(1000), 4096)

    count = counts.count_from_int(tokens)  # a token counter (T = 1): needs more than int32
    assert counts.count_to_int(counts.count_add(count, 16 * MI)) == tokens + 16 * MI
    warmup, total = 8e9, 1.56e13  # Llama 3 405B: 8000 steps × ~1M, 15.6T tokens
    lr = lr_schedule(8e-5, warmup_examples=warmup, total_examples=total, decay="cosine",
                     final_fraction=0.01)
    p = (tokens - warmup) / (total - warmup)
    expected = 8e-5 * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * p)))
    assert float(lr(counts.count_value(count))) == pytest.approx(expected, rel=1e-5)


def test_adaptive_calibrated_targets_the_predicted_b_crit():
    """rule="calibrated": the target is k times the B_crit the shipped calibration predicts
    from the observed noise scale for the optimizer's family, not k times the noise scale."""
    from cbs.results import calibration

    calib = calibration.shipped()
    nearest = lambda rungs, x: min(rungs, key=lambda r: abs(math.log(r / x)))
    for optimizer, source, k in (("sgd", "b_simple", 1.0), ("adam", "b_simple", 2.0),
                                 ("momentum", "b_noise", 1.0)):
        s = Adaptive(min_batch=8, max_batch=4096, initial=8, patience=1, k=k, source=source,
                     rule="calibrated", optimizer=optimizer)
        p = calibration.predict(calib["models"][source], 100.0, optimizer)
        assert s.ratio == pytest.approx(p["b_crit"] / 100.0, rel=1e-12)
        assert s.update(s.init(), 100.0, 0).batch_size == nearest(s.rungs, k * p["b_crit"])
    plain = Adaptive(min_batch=8, max_batch=4096, initial=8, patience=1)
    sgd = Adaptive(min_batch=8, max_batch=4096, initial=8, patience=1, rule="calibrated",
                   optimizer="sgd")
    assert plain.ratio == 1.0 and plain.update(plain.init(), 100.0, 0).batch_size == 128
    assert sgd.update(sgd.init(), 100.0, 0).batch_size == 64  # B_crit ≈ 0.63 × B_simple
    with pytest.raises(ValueError, match="rule must be one of"):
        Adaptive(min_batch=8, max_batch=64, rule="kaplan")
    with pytest.raises(ValueError, match="no calibrated family"):
        Adaptive(min_batch=8, max_batch=64, rule="calibrated", optimizer="lion")
    unbound = Adaptive(min_batch=8, max_batch=64, rule="calibrated")
    with pytest.raises(ValueError, match="config.optim.name"):
        unbound.update(unbound.init(), 100.0, 0)


def test_a_calibrated_schedule_is_validated_with_the_run_optimizer():
    c = config_lib.default_config()
    c.batch.micro_batch = 8
    c.batch.schedule = ml_collections.ConfigDict(
        {"kind": "adaptive", "min_batch": 8, "max_batch": 64, "rule": "calibrated"})
    config_lib.validate(c, data_replicas=1)
    built = sch.batch_schedule_from_config(c.batch.schedule, optimizer=c.optim.name)
    assert built.optimizer == c.optim.name and built.ratio > 0
    c.batch.schedule.rule = "nearest"
    with pytest.raises(ConfigError, match=r"config\.batch\.schedule: rule must be one of"):
        config_lib.validate(c, data_replicas=1)
