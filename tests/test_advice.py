"""The batch-size advice (`cbs.analysis.advice.advice`, `cbs-advise`)."""

import json
import math
import os
import re
import subprocess
import sys
import tomllib

import _warm
import jax
import numpy as np
import pytest
from conftest import SUBPROCESS_XLA_FLAGS
from test_train import one_device_mesh, tiny_config

from cbs import noise
from cbs.analysis.advice import advice
from cbs.engine import live_advice, trainer
from cbs.results import calibration, files, records
from cbs.runtime import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _f:
    SCRIPTS = tomllib.load(_f)["project"]["scripts"]  # console script -> module:function


def test_advice_is_the_calibrated_prediction_and_the_tradeoff():
    calib = calibration.shipped()
    a = advice.advise(200.0, optimizer="adamw", batch_size=512, exchange=50.0)
    p = calibration.predict(calib["models"]["b_simple"], 200.0, "adamw", level=0.8)
    assert a.b_crit == pytest.approx(p["b_crit"]) and a.interval == pytest.approx(p["interval"])
    assert a.steps_ratio == pytest.approx(1 + a.b_crit / 512)
    assert a.examples_ratio == pytest.approx(1 + 512 / a.b_crit)
    assert a.best_batch_size == pytest.approx(math.sqrt(50.0 * a.b_crit))
    assert a.interval[0] < a.b_crit < a.interval[1]
    assert a.calibration["studies"] == len(calib["studies"])
    # a wider level gives a wider interval around the same point
    b = advice.advise(200.0, optimizer="adamw", batch_size=512, level=0.95)
    assert b.interval[0] < a.interval[0] and b.interval[1] > a.interval[1]
    assert b.b_crit == pytest.approx(a.b_crit)


def test_a_noise_scale_from_few_examples_or_not_positive_is_flagged():
    few = advice.advise(80.0, optimizer="adam", batch_size=128, examples=128)
    assert any("128 examples" in f for f in few.flags)
    assert "note: noise scale from 128 examples" in advice.summary(few)
    bad = advice.advise(-3.0, optimizer="sgd", batch_size=128)
    assert math.isnan(bad.b_crit) and any("not positive" in f for f in bad.flags)


def _run_dir(path, optimizer="adam"):
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"optim": {"name": optimizer}, "batch": {"schedule": {"batch_size": 64}}}, f)
    rows = [{"step": 0, "kind": "eval", "full_train/loss": 2.3},
            {"step": 0, "kind": "train", "data/batch_size": 64, "noise/b_simple": 40.0,
             "noise/batch_size": 1024, "noise/ema_b_simple": 41.0},
            {"step": 5, "kind": "train", "data/batch_size": 64, "noise/ema_b_simple": 55.0},
            {"step": 10, "kind": "eval", "full_train/loss": 1.1},
            {"step": 10, "kind": "train", "data/batch_size": 64, "noise/b_simple": 90.0,
             "noise/batch_size": 1024}]
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def test_trajectory_reads_every_measured_step(tmp_path):
    run = _run_dir(str(tmp_path / "run"))
    tr = advice.trajectory(run)
    assert [a.step for a in tr] == [0, 10]
    assert [a.loss for a in tr] == [2.3, 1.1]
    assert [a.noise_scale for a in tr] == [40.0, 90.0]
    assert tr[1].b_crit == pytest.approx(advice.advise(90.0, optimizer="adam",
                                                       batch_size=64).b_crit)
    assert not tr[1].flags  # 1,024 examples: no flag


def test_cbs_advise_prints_the_answer_and_writes_the_trajectory(tmp_path):
    run = _run_dir(str(tmp_path / "run"), optimizer="sgd")
    out = _warm.python(["-m", "experiments.advise", f"--workdir={run}", "--exchange=100"])
    assert out.returncode == 0, out.stderr
    assert "predicted B_crit" in out.stdout and "sgd optimizers" in out.stdout
    assert "the batch that minimises" in out.stdout
    for name in ("advice.md", "advice.json", "advice.png"):
        assert os.path.getsize(os.path.join(run, name)) > 0
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    bad = _warm.python(["-m", "experiments.advise", f"--workdir={empty}"])
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "config.json" in bad.stderr


def _numbers_and_text(line):
    nums = [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?", line)]
    return nums, re.sub(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?", "#", line)


def test_the_readme_advice_command_prints_the_readme_block(tmp_path):
    """README's first answer: its command, run as shown (without the install), prints the
    block README quotes (numbers to 2 %: float32 sums may differ in the last digit between
    machines; every word the same)."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    command = re.search(r"```bash\n(pip install -e \. && cbs-train "
                        r"--config=digits_mlp:tiny[^\n]*)\n```", readme).group(1)
    block = readme.split("<!-- the output of the command above (tests/test_advice.py) -->"
                         )[1].split("```")[1].strip("\n").splitlines()
    work = str(tmp_path / "advise")
    parts = [p.strip() for p in command.split("&&")[1:]]
    outs = []
    for part in parts:
        argv = part.replace("runs/advise", work).split()
        script = argv[0]  # the console script: the module it runs (pyproject.toml)
        argv = ["python", "-m", SCRIPTS[script].split(":")[0], *argv[1:]]
        # one device, as shown; the tests' compile flags change no number beyond the 2 %
        env = _warm.base_env() | {"XLA_FLAGS": SUBPROCESS_XLA_FLAGS}
        done = _warm.python(argv[1:], env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        outs.append(done.stdout)
    got = outs[-1].strip("\n").splitlines()
    assert len(got) == len(block)
    for want_line, got_line in zip(block, got, strict=True):
        want_nums, want_text = _numbers_and_text(want_line)
        got_nums, got_text = _numbers_and_text(got_line)
        assert got_text == want_text
        np.testing.assert_allclose(got_nums, want_nums, rtol=0.02)


def test_trajectory_prefers_the_measurement_at_evaluations(tmp_path):
    run = str(tmp_path / "run")
    os.makedirs(run)
    with open(os.path.join(run, "config.json"), "w") as f:
        json.dump({"optim": {"name": "adam"}, "noise": {"examples": "all", "batch_size": 0},
                   "batch": {"schedule": {"batch_size": 32}}}, f)
    rows = [{"step": 0, "kind": "train", "data/batch_size": 32, "noise/ema_b_simple": 9.0},
            {"step": 0, "kind": "eval", "full_train/loss": 2.0, "noise/b_simple": 12.0},
            {"step": 4, "kind": "eval", "full_train/loss": 1.5, "noise/b_simple": 15.0}]
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tr = advice.trajectory(run)
    assert [(a.step, a.noise_scale, a.loss, a.batch_size) for a in tr] == [
        (0, 12.0, 2.0, 32.0), (4, 15.0, 1.5, 32.0)]
    assert "all training examples" in tr[0].source


# ------------------------------------------------------------------ live advice and checkpoints


def _trained(path, **overrides):
    """A tiny digits run (tests/test_train.py's 12 steps at B = 32, Adam, checkpoints every
    5) in `path`, with the overrides; its records."""
    c = tiny_config(**({"train.keep_checkpoints": 5} | overrides))
    trainer.run(c, str(path), mesh=one_device_mesh())
    return c, records.read_records(os.path.join(str(path), files.METRICS_FILE))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("advice_run")
    c, recs = _trained(path)
    return str(path), c, recs


def test_live_advice_is_the_calibrated_prediction_and_the_tradeoff():
    class Optim:
        name = "sgd"

    calib = calibration.shipped()
    live = live_advice.LiveAdvice.from_config(type("C", (), {"optim": Optim})())
    got = live.record({"noise/ema_b_simple": 150.0, "data/batch_size": 64})
    p = calibration.predict(calib["models"]["b_simple"], 150.0, "sgd", level=calib["level"])
    assert got["advice/b_crit"] == pytest.approx(p["b_crit"], rel=1e-12)
    assert (got["advice/b_crit_lo"], got["advice/b_crit_hi"]) == pytest.approx(p["interval"],
                                                                               rel=1e-12)
    assert got["advice/steps_ratio"] == pytest.approx(1 + p["b_crit"] / 64, rel=1e-12)
    assert got["advice/examples_ratio"] == pytest.approx(1 + 64 / p["b_crit"], rel=1e-12)
    assert sorted(got) == sorted(f"advice/{k}" for k in live_advice.ADVICE_KEYS)
    # the same numbers as the advice of a finished run
    a = advice.advise(150.0, optimizer="sgd", batch_size=64)
    assert (a.b_crit, a.steps_ratio, a.examples_ratio) == pytest.approx(
        (got["advice/b_crit"], got["advice/steps_ratio"], got["advice/examples_ratio"]))
    # no estimate (live "none": NaN EMA): no keys; an estimate <= 0: NaN advice
    assert live.record({"noise/ema_b_simple": math.nan, "data/batch_size": 64}) == {}
    bad = live.record({"noise/ema_b_simple": -3.0, "data/batch_size": 64})
    assert sorted(bad) == sorted(got) and all(math.isnan(v) for v in bad.values())


def test_a_run_with_a_live_estimate_logs_the_advice(tiny_run):
    _, c, recs = tiny_run
    trains = [r for r in recs if r["kind"] == "train"]
    assert len(trains) == 12
    ratio = math.exp(calibration.shipped()["models"]["b_simple"]["families"]["adaptive"]["mu"])
    for r in trains:
        assert all(f"advice/{k}" in r for k in live_advice.ADVICE_KEYS)
        b, b_crit = r["data/batch_size"], r["advice/b_crit"]
        assert b_crit == pytest.approx(ratio * r["noise/ema_b_simple"], rel=1e-9)
        assert r["advice/b_crit_lo"] < b_crit < r["advice/b_crit_hi"]
        assert r["advice/steps_ratio"] == pytest.approx(1 + b_crit / b, rel=1e-12)
        assert r["advice/examples_ratio"] == pytest.approx(1 + b / b_crit, rel=1e-12)
    assert not any(k.startswith("advice/") for r in recs if r["kind"] == "eval" for k in r)


def test_the_advice_from_a_checkpoint_is_the_measurement_of_that_state(tiny_run):
    """`measure_checkpoint` restores checkpoint 10 and measures on all training examples: the
    same B_simple as `cbs.noise.exact` on the restored parameters, directly (tr Σ over the N
    examples, |G|² of their mean gradient)."""
    run, c, recs = tiny_run
    measured = trainer.measure_checkpoint(run, 10, mesh=one_device_mesh())
    tr = trainer.Trainer(c, mesh=one_device_mesh())
    ckpt = checkpoint.Checkpointer(os.path.join(run, checkpoint.CHECKPOINT_DIR))
    state, _ = ckpt.restore(10, tr._restore_target())
    ckpt.close()
    n = tr.dataset.num_train
    everything = tr.dataset.take(tr.train_arrays, jax.numpy.arange(n), "train")
    loss = lambda p, b: tr.loss_fn(p, state.model_state, b)[0]
    direct = noise.exact(loss, state.params, everything, chunk_size=256)
    assert measured["examples"] == measured["num_train"] == n and measured["step"] == 10
    # on the whole training set G is the mean gradient itself: |G|² = |ḡ|², no 1/N correction
    b_simple = float(direct.trace_sigma / direct.mean_grad_sq_norm)
    assert measured["noise/b_simple"] == pytest.approx(b_simple, rel=1e-5)
    assert measured["batch_size"] == 32 and measured["optimizer"] == "adam"
    evals = {r["step"]: r for r in recs if r["kind"] == "eval"}
    assert measured["full_train/loss"] == pytest.approx(evals[12]["full_train/loss"], rel=0.05)
    a = advice.from_checkpoint(measured)
    b = advice.advise(measured["noise/b_simple"], optimizer="adam", batch_size=32)
    assert (a.b_crit, a.interval, a.steps_ratio) == (b.b_crit, b.interval, b.steps_ratio)
    assert a.step == 10 and a.examples == n and "all" in a.source
    # the tiny run's Adam at 0.001 and its loss of 2.3 lie outside the calibration: said first
    assert measured["task"] == "digits/mlp" and measured["learning_rate"] == 1e-3
    assert [o.split(" ")[0] for o in a.outside] == ["learning", "loss"]
    assert a.flags == [f"outside the calibration: {o}" for o in a.outside]
    # on a stated number of examples: a sampled measurement, flagged below FEW_EXAMPLES
    few = advice.from_checkpoint(trainer.measure_checkpoint(run, 10, examples=128,
                                                            mesh=one_device_mesh()))
    assert few.examples == 128 and few.flags and "128 of" in few.source


@pytest.mark.slow
def test_cbs_advise_from_a_checkpoint_prints_that_measurement(tiny_run, tmp_path):
    run, _, _ = tiny_run
    want = advice.from_checkpoint(trainer.measure_checkpoint(run, 5, mesh=one_device_mesh()))
    env = os.environ | {"XLA_FLAGS": SUBPROCESS_XLA_FLAGS}  # one device, as a user's run
    out = subprocess.run([sys.executable, "-m", "experiments.advise",
                          f"--checkpoint={run}/checkpoints/5", f"--out={tmp_path}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith(advice.summary(want))  # after the model's line
    saved = json.load(open(tmp_path / "advice_5.json"))
    # float32 sums on one CPU device differ in the last bits between a process of one host
    # device and this one of eight (XLA's thread partition): equal to float32 precision
    assert saved["advice"]["noise_scale"] == pytest.approx(want.noise_scale, rel=1e-6)
    bad = subprocess.run([sys.executable, "-m", "experiments.advise", f"--checkpoint={run}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "RUN/checkpoints/STEP" in bad.stderr


def test_cbs_advise_says_what_is_true_and_what_to_do(tiny_run, tmp_path):
    """A step with no checkpoint names the steps there are (the checkpoints are intact: no
    "delete it to start over"); a negative --exchange is a validation error, not "math
    domain error"; a run whose records hold no noise estimate (live "none": NaN) is measured
    at its latest checkpoint as promised, and without a checkpoint is told what to rerun."""
    import shutil

    run, _, _ = tiny_run
    env = _warm.base_env() | {"XLA_FLAGS": SUBPROCESS_XLA_FLAGS}

    def advise(*args):
        return _warm.python(["-m", "experiments.advise", *args], env=env)

    step = advise(f"--workdir={run}", "--step=7", f"--out={tmp_path / 'o'}")
    assert step.returncode == 2 and len(step.stderr.strip().splitlines()) == 1
    assert "no checkpoint at step 7" in step.stderr and "steps 0, 5, 10 and 12" in step.stderr
    assert "delete" not in step.stderr
    exchange = advise(f"--workdir={run}", "--exchange=-1")
    assert exchange.returncode == 2 and "math domain" not in exchange.stderr
    assert exchange.stderr.startswith("error: --exchange=-1: λ is the examples you would "
                                      "spend to save one step, a number > 0")
    quiet = str(tmp_path / "quiet")
    shutil.copytree(run, quiet)
    path = os.path.join(quiet, files.METRICS_FILE)
    rows = [{k: (math.nan if k.startswith(("noise/", "advice/")) else v) for k, v in r.items()}
            for r in records.read_records(path)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert advice.trajectory(quiet) == []  # NaN is no measurement
    measured = advise(f"--workdir={quiet}", "--examples=128")
    assert measured.returncode == 0, measured.stderr
    assert "not positive" not in measured.stdout
    assert (f"{quiet} records no measured b_simple: measuring it at the latest checkpoint "
            "(128 training examples)") in measured.stdout
    assert "at step 12 (sampled measurement of 128 of 1438 training examples at checkpoint " \
           "12" in measured.stdout
    shutil.rmtree(os.path.join(quiet, checkpoint.CHECKPOINT_DIR))
    none = advise(f"--workdir={quiet}")
    assert none.returncode == 2 and len(none.stderr.strip().splitlines()) == 1
    assert "records no measured b_simple and has no checkpoint to measure it at: rerun it " \
           "with --config.noise.every=100" in none.stderr


def test_a_calibrated_ramp_follows_the_predicted_b_crit(tmp_path):
    """An adaptive ramp with rule="calibrated" (SGD: B_crit ≈ 0.63 × B_simple): every batch
    size the run took is the schedule's answer to the live B_simple it observed, and each move
    lands on the rung nearest the predicted B_crit the run logged (advice/b_crit)."""
    import ml_collections

    from cbs.engine.adaptive import Adaptive

    schedule = {"kind": "adaptive", "min_batch": 8, "max_batch": 512, "initial": 8,
                "patience": 1, "multiple": 8, "rule": "calibrated"}
    _, recs = _trained(tmp_path, **{"optim.name": "sgd", "optim.learning_rate": 0.1,
                                    "batch.adapt_every": 2,
                                    "batch.schedule": ml_collections.ConfigDict(schedule)})
    trains = {r["step"]: r for r in recs if r["kind"] == "train"}
    s = Adaptive(**{k: v for k, v in schedule.items() if k != "kind"}, optimizer="sgd")
    state = s.init()
    moves = 0
    for t in range(1, 12):
        before = trains[t - 1]
        if t % 2 == 0:  # the loop feeds the EMA after step t - 1
            state = s.update(state, before["noise/ema_b_simple"], trains[t]["data/examples_seen"])
        assert trains[t]["data/batch_size"] == state.batch_size
        if state.batch_size != before["data/batch_size"]:
            moves += 1
            target = min(max(before["advice/b_crit"], s.min_batch), s.max_batch)
            assert state.batch_size == min(s.rungs, key=lambda r: abs(math.log(r / target)))
    assert moves >= 1


def test_a_prediction_names_the_examples_its_noise_scale_was_measured_on():
    """A one-run prediction's source follows the sweep's noise protocol: the whole training
    set (the teacher–student task's 8,192 examples) or the sampled windows (the depth-4 LM:
    5 measurements of 128 sequences at the crossing, not its 140,257 training windows)."""
    from cbs.analysis.advice import advice as advice_lib

    lm = advice_lib.from_sweep(os.path.join(ROOT, "results", "heldout_lm_depth4_predict"))
    assert {a.examples for a in lm} == {640}
    assert all("sampled, 5 × 128" in a.source for a in lm)
    ts = advice_lib.from_sweep(os.path.join(ROOT, "results",
                                            "heldout_teacher_student_predict"))
    assert {a.examples for a in ts} == {8192}
    assert all("full training set" in a.source for a in ts)


def _digits_run(path, learning_rate, loss):
    """A run directory of digits/mlp with Adam at `learning_rate`, B = 128, one evaluation
    at step 10 with the full training loss `loss` and B_simple 70 on all 1,438 examples."""
    os.makedirs(path)
    config = {"optim": {"name": "adam", "learning_rate": learning_rate},
              "data": {"name": "digits"}, "model": {"name": "mlp"},
              "batch": {"schedule": {"batch_size": 128}},
              "noise": {"examples": "all", "batch_size": 1438}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    row = {"kind": "eval", "step": 10, "full_train/loss": loss, "noise/b_simple": 70.0}
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write(json.dumps(row) + "\n")
    return path


def test_advice_outside_its_calibration_says_so_in_its_first_line(tmp_path):
    """The guide's run at digits_mlp's default rate (Adam 0.001 at B = 128, 23× below the
    0.0226 the committed sweep found best there) is told first that B_crit at an untuned rate
    is not what the calibration measured; at the tuned rate and a calibrated loss nothing is
    said; a loss above every calibrated target of the data set is named too."""
    untuned = advice.trajectory(_digits_run(str(tmp_path / "a"), 1e-3, 0.2))[-1]
    first = advice.summary(untuned).splitlines()[0]
    assert first.startswith("outside the calibration: learning rate 0.001 is 22.6× below the "
                            "best 0.0226 that this task's sweep found at B = 128")
    tuned = advice.trajectory(_digits_run(str(tmp_path / "b"), 0.0226, 0.2))[-1]
    assert tuned.outside == () and advice.summary(tuned).startswith("b_simple = 70")
    early = advice.trajectory(_digits_run(str(tmp_path / "c"), 0.0226, 1.5))[-1]
    assert early.outside == ("loss 1.5 is above every target calibrated on digits "
                             "(0.05–0.5): B_crit there was not measured",)
    assert "| loss |" in advice.table([early]) and "| – |" in advice.table([tuned])


def test_a_tiny_lm_is_told_it_lies_outside_the_calibration(tmp_path):
    """lm_shakespeare.py:tiny (the scanned LM, not the calibrated character Transformer), at a
    loss of 4 nats far above the calibrated 2.1–3.0, with a B_simple under one sequence: the
    advice's first line says all three before the number."""
    work = str(tmp_path / "lm")
    env = _warm.base_env() | {"XLA_FLAGS": SUBPROCESS_XLA_FLAGS}
    done = _warm.python(["-m", "experiments.main",
                         "--config=experiments/configs/lm_shakespeare.py:tiny",
                         f"--workdir={work}"], env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = _warm.python(["-m", "experiments.advise", f"--workdir={work}"], env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    first = out.stdout.splitlines()[0]
    assert first.startswith("outside the calibration: predicted B_crit ")
    assert "task shakespeare_char/lm with adaptive optimizers is not in the calibration" in first
    assert "above every target calibrated on shakespeare_char (2.1–3)" in first
