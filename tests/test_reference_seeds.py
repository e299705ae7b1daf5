"""One noise protocol: the reference trajectory over seeds (cbs.sweeps.reference_seeds) and
its analysis (cbs.analysis.studies.reference_protocol).

The update's noise scale is checked against float64 definitions on the whole training set;
the spread over seeds against closed forms on synthetic records; the command end to end on a
tiny sweep."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbs.analysis.studies import compare, reference_protocol
from cbs.engine.noise_spec import NoiseSpec
from cbs.results import files, paths, records
from cbs.sweeps import reference_seeds
from tests.test_preconditioned import _loss, _problem


@jax.jit
def _full_data_reference(params, batch, precond, subset):
    """float64 definitions of the "full_data" statistics of the update P·g on all N examples
    (tr(PHPΣ) from the deviations of `subset`, H over all N)."""
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    p = jax.flatten_util.ravel_pytree(precond)[0]
    one = lambda f, x: _loss(unravel(f), jax.tree.map(lambda a: a[None], x))
    g = jax.vmap(jax.grad(one), in_axes=(None, 0))(flat, batch)
    h = jax.hessian(lambda f: _loss(unravel(f), batch))(flat)
    n = g.shape[0]
    gbar = g.mean(0)
    d = g - gbar
    php = p[:, None] * h * p[None, :]
    tr_p_sigma = jnp.einsum("bi,i,bi->", d, p, d) / (n - 1)
    forms = jnp.einsum("bi,ij,bj->b", d, php, d)
    tr_php_sigma = n / (n - 1) * jnp.mean(forms[subset])
    gpg, gphpg = gbar @ (p * gbar), gbar @ php @ gbar
    return {"trace_sigma": tr_p_sigma, "grad_sq_norm": gpg, "b_simple": tr_p_sigma / gpg,
            "trace_h_sigma": tr_php_sigma, "g_h_g": gphpg, "b_noise": tr_php_sigma / gphpg}


def test_the_update_noise_scale_on_all_examples_equals_float64(x64):
    """`update_measurement`: the reference run's own estimator ("full_data": exact G, tr(Σ),
    GᵀHG; tr(HΣ) from m random deviations and the full-data Hessian) in the update's
    coordinates gives the float64 definitions of B_simple^P and B_noise^P."""
    params, batch, precond = jax.tree.map(lambda a: a.astype(jnp.float64),
                                          _problem(jax.random.key(0)))
    deviations = 5  # of n = 12: a random subset
    spec = NoiseSpec(examples="all", curvature=True, deviations=deviations)
    key = jax.random.key(3)
    got = reference_seeds.update_measurement(spec, _loss, params, precond, batch, None, key)
    n = batch["x"].shape[0]
    subset = np.asarray(jax.random.choice(jax.random.split(key)[0], n, (deviations,),
                                          replace=False))
    want = _full_data_reference(params, batch, precond, subset)
    for k, v in want.items():  # computed in float64, returned in float32 ("full_data")
        assert float(got[k]) == pytest.approx(float(v), rel=1e-6), k
    plain = _full_data_reference(params, batch, jax.tree.map(jnp.ones_like, precond), subset)
    assert float(plain["b_noise"]) != pytest.approx(float(got["b_noise"]), rel=1e-2)


def _run(seed, scale, *, precond=True):
    """A seed's record: loss 1/(1 + step/10) (crossing L = 0.5 at step 10, L = 0.25 at 30);
    tr(Σ) = scale·step, |G|² = 1; tr(HΣ) = 2·scale, GᵀHG = 1; the update's statistics 3× the
    plain ones' numerators; NaN (not measured) before step 8."""
    steps = [0, 4, 8, 10, 12, 14, 20, 30, 35, 40, 50]
    nan = [None if s < 8 else 1.0 for s in steps]
    grows = lambda a: [None if s < 8 else a * s for s in steps]
    curve = {"step": steps, "full_train/loss": [1 / (1 + s / 10) for s in steps],
             "noise/step": steps, "noise/trace_sigma": grows(scale),
             "noise/grad_sq_norm": nan,
             "noise/trace_h_sigma": [None if v is None else 2.0 * scale for v in nan],
             "noise/g_h_g": nan}
    if precond:
        curve |= {"noise_p/trace_sigma": grows(3 * scale),
                  "noise_p/grad_sq_norm": nan,
                  "noise_p/trace_h_sigma": [None if v is None else 6.0 * scale for v in nan],
                  "noise_p/g_h_g": nan}
    return {"batch_size": 8, "learning_rate": 0.01, "seed": seed, "lowest_target": 0.25,
            "b_crit_lowest_target": 40.0, "deviations": 256, "optimizer": "adam",
            "protocol": "one run", "target_metric": "full_train/loss", "curve": curve}


def test_the_spread_over_seeds_on_synthetic_records():
    runs = [_run(0, 1.0), _run(1, 2.0), _run(2, 8.0)]
    s = reference_protocol.summarize(runs, [0.5, 0.25, 0.01], window=3)
    first, second, never = s["targets"]
    # L = 0.5: crossing at step 10, the first 3 measurements 10, 12, 14: B_simple = 12·scale
    assert first["crossings"] == pytest.approx([10.0] * 3)
    assert first["b_simple"]["values"] == pytest.approx([12.0, 24.0, 96.0])
    assert first["b_simple"]["median"] == pytest.approx(24.0)
    assert (first["b_simple"]["min"], first["b_simple"]["max"]) == pytest.approx((12.0, 96.0))
    logs = np.log([12.0, 24.0, 96.0])
    assert first["b_simple"]["gsd"] == pytest.approx(math.exp(np.std(logs, ddof=1)))
    assert first["b_noise"]["median"] == pytest.approx(4.0)  # 2·scale, scale 2
    assert first["b_simple_p"]["median"] == pytest.approx(72.0)  # 3× B_simple
    assert first["b_noise_p"]["values"] == pytest.approx([6.0, 12.0, 48.0])
    # L = 0.25: crossing at 30, measurements 30, 35, 40
    assert second["b_simple"]["values"] == pytest.approx([35.0, 70.0, 280.0])
    assert never["b_simple"]["seeds"] == 0 and math.isnan(never["b_simple"]["median"])
    assert s["batch_size"] == 8 and s["seeds"] == [0, 1, 2]
    assert "B_crit/5" in s["protocol"] and "3 seeds" in s["protocol"]
    text = reference_protocol.markdown(s)
    assert "| 0.5 | 24 (12–96) ×" in text and "B_noise^P" in text
    # a measurement before the crossing is never read: the first window starts at/after it
    early = _run(0, 1.0)
    early["curve"]["noise/trace_sigma"][1] = 1e9  # step 4, before the crossing at 10
    assert reference_protocol.seed_values(early, [0.5], 3)[0]["b_simple"] == pytest.approx(12)
    # SGD: no update statistics recorded, none reported
    sgd = reference_protocol.summarize([_run(0, 1.0, precond=False)], [0.5], window=3)
    assert "b_noise_p" not in sgd["targets"][0] and math.isnan(sgd["targets"][0]["b_simple"]
                                                                ["gsd"])


def test_the_batch_size_is_the_largest_at_most_b_crit_over_four():
    from cbs.sweeps.grid import default_sweep_config

    s = default_sweep_config()
    s.batch_sizes = (4, 8, 16, 32, 64)
    assert reference_seeds.choose_batch_size(s, 232.5) == 32  # 58.1
    assert reference_seeds.choose_batch_size(s, 64.0) == 16  # exactly B_crit/4
    with pytest.raises(ValueError, match="B_crit/4"):
        reference_seeds.choose_batch_size(s, 12.0)


def _tiny_adam_study(d: str) -> None:
    """A tiny Adam study in `d` (local or gs://): its definition and one finished trial at
    B = 8 and 32, with a fitted B_crit of 150 at its lowest target (B = 32 is then ≤
    B_crit/4)."""
    from cbs.results.store import SweepStore, TrialResult
    from cbs.sweeps import launch
    from experiments.configs import digits_sweep

    c = digits_sweep.get_config("tiny")
    c.model.hidden_sizes = (8,)
    c.sweep.update(dict(batch_sizes=(8, 32), targets=(2.0, 1.5), max_steps=60,
                        noise_window=2))
    st = SweepStore(d)
    st.write_definition(launch.sweep_definition(c, []))
    st.append([TrialResult(
        trial_id=f"b{b}", index=k, batch_size=b, learning_rate=0.02, seed=0, status="done",
        target_metric="full_train/loss", steps_to_target={"2.0": 10.0, "1.5": 30.0},
        examples_to_target={}, noise_at_target={}, final_steps=60, final_metric=1.0,
        curve={}, seconds=0.0) for k, b in enumerate((8, 32))])
    records.write_json_atomic(paths.join(d, files.ANALYSIS_FILE), {
        "targets": [{"target": 2.0, "fit": {"b_crit": 60.0}},
                    {"target": 1.5, "fit": {"b_crit": 150.0}}]})


@pytest.mark.slow  # two reference runs
def test_a_reference_run_over_chunks_of_the_training_set_measures_the_same(tmp_path,
                                                                          monkeypatch):
    """The seed reference run of a tiny Adam study with its N = 1,438 digits measured in one
    pass and in chunks of 128 (`cbs.stats.sampled.FULL_DATA_CHUNK`, the path of training sets
    over 32,768 examples), inside the vmapped group and in the update's coordinates: the
    same plain and preconditioned statistics at every evaluation (float32 sums in another
    order)."""
    from cbs.stats import sampled

    curves = []
    for one_pass in (sampled.FULL_DATA_ONE_PASS, 256):
        d = str(tmp_path / f"s{one_pass}")
        _tiny_adam_study(d)
        monkeypatch.setattr(sampled, "FULL_DATA_ONE_PASS", one_pass)
        monkeypatch.setattr(sampled, "FULL_DATA_CHUNK", 128)
        reference_seeds.run_seeds(d, seeds=1, evals=8, log=lambda *_: None)
        curves.append(records.read_records(reference_seeds.seed_path(d, 0))[0]["curve"])
    one, chunked = curves
    assert one["full_train/loss"] == chunked["full_train/loss"]  # the same trajectory
    measured = 0
    for key in [k for k in one if k.startswith(("noise/", "noise_p/")) and k != "noise/step"]:
        for a, b in zip(one[key], chunked[key], strict=True):
            assert (a is None) == (b is None), key
            if a is not None and key != "noise/ema_b_simple":
                assert b == pytest.approx(a, rel=1e-5), key  # measured: <= 2.5e-7
                measured += 1
    assert measured > 20


@pytest.mark.slow  # three reference runs, each compiled for its own seed
def test_the_command_on_a_tiny_sweep(tmp_path):
    """The command on a tiny Adam study (its definition and one finished trial at each batch
    size): three seeds at B ≤ B_crit/4, each written once with the plain and the update's
    statistics at every evaluation past the first target; the comparison reads them."""
    from experiments import reference

    d = str(tmp_path / "s")
    _tiny_adam_study(d)
    assert reference.main([f"--sweep_dir={d}", "--seeds=3", "--evals=8"]) == 0
    runs = [records.read_records(reference_seeds.seed_path(d, k)) for k in range(3)]
    assert [len(r) for r in runs] == [1, 1, 1]
    first = runs[0][0]
    assert (first["batch_size"], first["deviations"], first["preconditioner"]) == (32, 256,
                                                                                    "adam")
    assert first["b_crit_lowest_target"] == 150.0 and first["lowest_target"] == 1.5
    assert {r[0]["learning_rate"] for r in runs} == {0.02}
    curves = [r[0]["curve"] for r in runs]
    assert curves[0]["full_train/loss"] != curves[1]["full_train/loss"]  # another seed
    loss = np.asarray(curves[0]["full_train/loss"])
    ts = np.asarray([np.nan if v is None else v for v in curves[0]["noise/trace_sigma"]])
    tp = np.asarray([np.nan if v is None else v for v in curves[0]["noise_p/trace_sigma"]])
    below = np.maximum.accumulate(loss <= 2.0)
    assert below.any() and not below.all()
    assert np.all(np.isfinite(ts[below])) and np.all(np.isnan(ts[~below]))
    assert np.all(np.isfinite(tp[below])) and not np.allclose(tp[below], ts[below])
    mtime = os.path.getmtime(reference_seeds.seed_path(d, 0))
    reference_seeds.run_seeds(d, seeds=3, evals=8)  # written once: nothing reruns
    assert os.path.getmtime(reference_seeds.seed_path(d, 0)) == mtime
    summary = reference_protocol.load(d)
    assert summary["seeds"] == [0, 1, 2] and summary["batch_size"] == 32
    row = compare._protocol_fields(summary, 2.0, 60.0, "adam")
    assert row["ref_b_simple_seeds"] == 3
    assert row["ref_update_b_noise"] == summary["targets"][0]["b_noise_p"]["median"]
    with pytest.raises(Exception, match="256"):
        reference_seeds.run_seeds(d, seeds=3, deviations=64)


def test_the_window_standard_error_in_closed_form():
    """window_se: the delta method over the window's k measurements."""
    x = np.arange(6.0)
    num = np.asarray([9.0, 1.0, 2.0, 3.0, 9.0, 9.0])
    den = np.ones(6)
    # crossing at 1, window 3: num 1, 2, 3 (mean 2, sample variance 1), den constant
    got = reference_protocol.window_se(x, num, den, 1.0, 3)
    assert got == pytest.approx(math.sqrt(1.0 / 3 / 4))
    # numerator and denominator moving together: the ratio is constant, no error
    assert reference_protocol.window_se(x, num, num, 1.0, 3) == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(reference_protocol.window_se(x, num, den, 4.5, 3))  # one measurement
    assert math.isnan(reference_protocol.window_se(x, num, den, None, 3))
    runs = [_run(0, 1.0), _run(1, 2.0)]
    row = reference_protocol.summarize(runs, [0.5], window=3)["targets"][0]
    # tr(Σ) = scale·step over steps 10, 12, 14, |G|² = 1: se = sd(10, 12, 14)/√3/12
    assert row["b_simple"]["se"] == pytest.approx([2 / math.sqrt(3) / 12] * 2)
    assert "±10%" in reference_protocol.markdown(reference_protocol.summarize(
        runs, [0.5], window=3))


def test_the_sampled_protocol_measures_only_the_windows(tmp_path):
    """The sampled protocol (n examples of a stream, m deviations, h Hessian examples) on a
    tiny Adam study: measured at exactly the `noise_window` evaluations from each target's
    first crossing (the ones the protocol reads), B_simple^P of the update but not its
    curvature, and the settings in the record."""
    d = str(tmp_path / "s")
    _tiny_adam_study(d)
    reference_seeds.run_seeds(d, seeds=1, evals=12, examples=64, deviations=8,
                              hessian_examples=16, log=lambda *_: None)
    run = records.read_records(reference_seeds.seed_path(d, 0))[0]
    assert (run["method"], run["examples"], run["deviations"], run["hessian_examples"]) == (
        "sampled", 64, 8, 16)
    assert "n=64" in run["protocol"] and "h=16" in run["protocol"]
    curve = run["curve"]
    loss = np.asarray(curve["full_train/loss"])
    want = set()
    for target in (2.0, 1.5):  # noise_window = 2
        hit = np.flatnonzero(loss <= target)
        if hit.size:
            want |= {int(i) for i in hit[:1]} | {int(hit[0]) + 1}
    want = {i for i in want if i < len(loss)}
    measured = {i for i, v in enumerate(curve["noise/trace_sigma"]) if v is not None}
    assert want and measured == want
    assert {i for i, v in enumerate(curve["noise_p/b_simple"]) if v is not None} == want
    assert all(v is None for v in curve["noise_p/b_noise"])  # no HVPs of the update
    assert all(curve["noise/b_noise"][i] is not None for i in want)
    summary = reference_protocol.load(d)
    assert summary["targets"][0]["b_simple"]["seeds"] == 1
    with pytest.raises(Exception, match="2 <= m"):
        reference_seeds.run_seeds(d, seeds=2, examples=4, deviations=8)
