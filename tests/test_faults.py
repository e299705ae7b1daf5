"""Faults injected on purpose: torn and corrupt records, damaged checkpoints, another model's
workdir, an unreachable network, bad command lines. Each test asserts what the user gets:
records intact and complete after a rerun, one line on stderr, the exit status, the time it
takes, and no directory left behind.

The network is never used: a download goes through an HTTPS proxy on a closed 127.0.0.1 port.
Faults that would otherwise give silently wrong answers (a reused sweep directory, models the
noise API cannot measure, late config errors, partial reruns, a full disk) are in
test_faults_silent.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import time
import warnings

import _warm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SUBPROCESS_XLA_FLAGS

from cbs.engine import trainer
from cbs.results import files, paths, records, shared
from cbs.results.store import SweepStore, TrialResult
from cbs.runtime import checkpoint, cli
from cbs.runtime import mesh as mesh_lib
from cbs.stats import noise
from cbs.sweeps import launch, ramps
from experiments.configs import digits_mlp, digits_sweep

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "experiments" / "configs"


# ----------------------------------------------------------------------------- helpers

def _closed_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _offline_env(monkeypatch=None) -> dict[str, str]:
    proxy = f"http://127.0.0.1:{_closed_port()}"
    env = {"HTTPS_PROXY": proxy, "https_proxy": proxy, "HTTP_PROXY": proxy,
           "http_proxy": proxy, "NO_PROXY": "", "no_proxy": ""}
    if monkeypatch is not None:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    return env


def _cli(module: str, *args: str, env: dict | None = None, timeout: float = 180):
    """Runs `python -m experiments.<module> args` from the repository root on one CPU device;
    returns (exit status, non-empty stderr lines, seconds)."""
    full = {k: v for k, v in os.environ.items() if k != "CBS_VERBOSE"}
    full.update({"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                 "XLA_FLAGS": SUBPROCESS_XLA_FLAGS} | (env or {}))
    start = time.perf_counter()
    proc = _warm.python(["-m", f"experiments.{module}", *args], env=full, timeout=timeout)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return proc.returncode, lines, time.perf_counter() - start


def _tiny_run_config(steps: int = 20):
    c = digits_mlp.get_config("tiny")
    c.train.max_steps = steps  # checkpoints every 10 steps (make_tiny)
    c.train.progress_bar = False
    c.train.tensorboard = False
    return c


def _one_device():
    return mesh_lib.make_mesh(data=1, model=1, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> pathlib.Path:
    """A finished 20-step tiny digits run (checkpoints at steps 10 and 20)."""
    workdir = tmp_path_factory.mktemp("run") / "run"
    trainer.run(_tiny_run_config(20), str(workdir), mesh=_one_device())
    return workdir


# ----------------------------------------------------------------------------- 1. records

def _result(i: int) -> TrialResult:
    return TrialResult(trial_id=f"t{i}", index=i, batch_size=8 * (i + 1), learning_rate=1e-3,
                       seed=0, status="done", target_metric="train/loss",
                       steps_to_target={"1": 10.0 + i}, examples_to_target={"1": 80.0 + i},
                       noise_at_target={}, final_steps=20, final_metric=0.5, curve={},
                       seconds=1.0)


def test_an_older_trials_file_with_a_torn_tail_is_read_and_copied_before_the_first_part(
        tmp_path):
    store = SweepStore(str(tmp_path / "sweep"))
    os.makedirs(store.sweep_dir)
    records.append_records(store.path, [_result(0).to_json(), _result(1).to_json()])
    with open(store.path, "ab") as f:
        f.write(b'{"trial_id": "t2", "index": 2, "batch_')  # killed mid-write
    assert [r["trial_id"] for r in store.records()] == ["t0", "t1"]
    store.append([_result(2)])  # a part; the file's whole lines are copied first
    assert [r["trial_id"] for r in store.records()] == ["t0", "t1", "t2"]
    store.export()
    lines = pathlib.Path(store.path).read_text().splitlines()
    assert [json.loads(line)["trial_id"] for line in lines] == ["t0", "t1", "t2"]


def test_corrupt_middle_line_is_named_and_its_trial_reruns(tmp_path):
    store = SweepStore(str(tmp_path / "sweep"))
    store.append([_result(i) for i in range(3)])
    [part] = shared.part_paths(store.path)
    lines = pathlib.Path(part).read_bytes().split(b"\n")
    lines[1] = b"\x00\x00garbage" + lines[1][20:]  # line 2 damaged in place
    pathlib.Path(part).write_bytes(b"\n".join(lines))
    with pytest.warns(records.CorruptRecordWarning, match=r"trials\.d/\d+-t0-\w+\.jsonl:2: skip"):
        assert store.finished_ids() == {"t0", "t2"}  # t1 counts as unfinished
    # valid JSON without the fields a trial record needs is corrupt too
    with open(part, "ab") as f:
        f.write(b'{"something": "else"}\n')
    with pytest.warns(records.CorruptRecordWarning, match=r":4: .*missing trial_id"):
        assert [r["trial_id"] for r in store.records()] == ["t0", "t2"]


def test_metrics_writer_repairs_a_torn_metrics_file(tmp_path):
    from cbs.runtime import writer

    path = tmp_path / files.METRICS_FILE
    records.append_records(str(path), [{"step": s, "kind": "train"} for s in range(3)])
    with open(path, "ab") as f:
        f.write(b'{"step": 3, "ki')
    w = writer.MetricsWriter(str(tmp_path), start_step=3, progress=False, tensorboard=False)
    w.write([{"step": 3, "kind": "train"}])
    w.close()
    assert [r["step"] for r in records.read_records(str(path))] == [0, 1, 2, 3]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_sweep_rerun_after_torn_and_corrupt_lines_restores_every_record(tmp_path):
    c = digits_sweep.get_config("tiny")
    s = c.sweep
    s.batch_sizes, s.lr_factors = (8,), (1.0, 2.0)  # one vmapped group of two trials
    s.max_steps, s.evals_per_trial, c.noise.curvature = 12, 3, False
    sweep_dir = str(tmp_path / "sweep")
    launch.run_sweep(c, sweep_dir, log=lambda _: None)
    store = SweepStore(sweep_dir)
    before = {r["trial_id"]: r for r in store.records()}
    assert len(before) == 2
    [part] = shared.part_paths(store.path)  # the group's records
    first, second = pathlib.Path(part).read_bytes().split(b"\n")[:2]
    pathlib.Path(part).write_bytes(b"{oops" + first[5:] + b"\n" + second[: len(second) // 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert launch.pending_trials(c, store) != []  # both count as unfinished
        launch.run_sweep(c, sweep_dir, log=lambda _: None)  # resumes from the group checkpoint
    assert any(".jsonl:1: skipped" in str(w.message) for w in caught)
    damaged, new = shared.part_paths(store.path)  # the damaged part stays for inspection
    assert damaged == part
    parsed = [json.loads(line) for line in pathlib.Path(new).read_text().splitlines()]
    assert sorted(r["trial_id"] for r in parsed) == sorted(before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", records.CorruptRecordWarning)
        after = {r["trial_id"]: r for r in store.records()}
    for trial_id, rec in before.items():  # the same results, not new ones
        assert {k: v for k, v in after[trial_id].items() if k != "seconds"} == {
            k: v for k, v in rec.items() if k != "seconds"}
    assert launch.run_sweep(c, sweep_dir, log=lambda _: None) == []  # nothing left to do


# ----------------------------------------------------------------------------- 4. TFDS

def test_offline_download_fails_within_10_s_in_one_line(tmp_path, monkeypatch):
    pytest.importorskip("tensorflow_datasets")
    import cbs.data as data

    _offline_env(monkeypatch)
    start = time.perf_counter()
    with pytest.raises(ConnectionError) as err:
        data.get_dataset("mnist", data_dir=str(tmp_path / "tfds"), download=True)
    assert time.perf_counter() - start < 10.0
    assert "\n" not in str(err.value) and "127.0.0.1" in str(err.value)
    assert "tfds build mnist" in str(err.value)


def test_documented_download_flag_reaches_the_dataset_and_fails_in_one_line(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    workdir = tmp_path / "w"
    rc, lines, _ = _cli("main", f"--config={CONFIGS / 'cnn.py'}:tiny", f"--workdir={workdir}",
                        "--config.data.options.download=True",
                        f"--config.data.options.data_dir={tmp_path / 'tfds'}", env=_offline_env())
    assert rc == cli.USER_ERROR_EXIT
    assert len(lines) == 1 and lines[0].startswith("error: cannot download TFDS dataset 'mnist'")
    assert not workdir.exists()


# ----------------------------------------------------------------------------- 5. checkpoints

def _damage(step_dir: pathlib.Path) -> None:
    for path in step_dir.rglob("manifest.ocdbt"):
        path.write_bytes(b"")  # cut short: the array index cannot be read


def test_damaged_latest_checkpoint_falls_back_and_the_run_completes(tmp_path, run_dir):
    workdir = tmp_path / "run"
    shutil.copytree(run_dir, workdir)
    ckpt_dir = workdir / checkpoint.CHECKPOINT_DIR
    assert sorted(int(p.name) for p in ckpt_dir.iterdir()) == [10, 20]
    _damage(ckpt_dir / "20")
    with pytest.warns(checkpoint.SkippedCheckpointWarning,
                      match=r"step 20 .*DATA_LOSS.*resuming from step 10"):
        summary = trainer.run(_tiny_run_config(30), str(workdir), mesh=_one_device())
    assert summary["step"] == 30
    assert (workdir / (checkpoint.CHECKPOINT_DIR + checkpoint.SKIPPED_SUFFIX) / "20").is_dir()
    steps = [r["step"] for r in records.read_records(str(workdir / files.METRICS_FILE))
             if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 29  # no duplicate, none missing
    assert set(range(0, 30, 5)) <= set(steps)


def test_checkpointer_keeps_at_least_two(tmp_path):
    ckpt = checkpoint.Checkpointer(str(tmp_path), max_to_keep=1, async_save=False)
    for s in (1, 2, 3):
        ckpt.save(s, {"w": jnp.ones(3) * s}, {"step": s})
    ckpt.close()
    assert ckpt.all_steps() == [2, 3]


def test_workdir_of_another_model_is_one_line(tmp_path, run_dir):
    workdir = tmp_path / "run"
    shutil.copytree(run_dir, workdir)
    rc, lines, _ = _cli("main", f"--config={CONFIGS / 'digits_mlp.py'}:tiny",
                        f"--workdir={workdir}", "--config.model.hidden_sizes=(32,)",
                        "--config.train.max_steps=30")
    assert rc == cli.USER_ERROR_EXIT, lines
    assert len(lines) == 1, lines
    assert "holds another model's checkpoint" in lines[0] and "use a new workdir" in lines[0]


# ----------------------------------------------------------------------------- 6. command line

def _readonly_dir(tmp_path) -> pathlib.Path:
    """A directory nobody may create entries in (for root, whom chmod does not stop, /sys)."""
    if os.geteuid() == 0:
        return pathlib.Path("/sys")
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o555)
    return path


@pytest.mark.parametrize("case", ["config_word", "config_field", "dataset", "file_as_dir",
                                  "read_only", "shard", "config_syntax", "config_raises",
                                  "sweep_targets"])
def test_user_errors_are_one_line_with_status_2_and_leave_no_directory(tmp_path, case):
    digits, out = f"--config={CONFIGS / 'digits_mlp.py'}:tiny", tmp_path / "new" / "run"
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    syntax, raises = tmp_path / "syntax.py", tmp_path / "raises.py"
    syntax.write_text("def get_config(arg=''):\n    c = dict(a=1\n    return c\n")
    raises.write_text("def get_config(arg=''):\n    return {}['model']\n")
    module, args, expect = {
        "sweep_targets": ("sweep", [f"--config={CONFIGS / 'digits_sweep.py'}:tiny",
                                    f"--sweep_dir={out}", "--config.sweep.targets=abc"],
                          "config.sweep.targets: must be a list of numbers > 0"),
        "config_syntax": ("main", [f"--config={syntax}", f"--workdir={out}"],
                          f"error: {syntax}:2: SyntaxError: '(' was never closed"),
        "config_raises": ("main", [f"--config={raises}:tiny", f"--workdir={out}"],
                          f"error: {raises}:2: KeyError: 'model'"),
        "config_word": ("main", [f"--config={CONFIGS / 'digits_mlp.py'}:tinny",
                                 f"--workdir={out}"], "unknown config argument 'tinny'"),
        "config_field": ("main", [digits, f"--workdir={out}", "--config.optim.learning_rte=1"],
                         "--config.optim.learning_rte=1: no such config field"),
        "dataset": ("main", [f"--config={CONFIGS / 'cnn.py'}:tiny", f"--workdir={out}",
                             f"--config.data.options.data_dir={tmp_path / 'tfds'}"],
                    "config.data.options.download=True"),
        "file_as_dir": ("main", [digits, f"--workdir={a_file}/run"], "Not a directory"),
        "read_only": ("main", [digits, f"--workdir={_readonly_dir(tmp_path)}/cbs_run"],
                      "choose a location you can write to"),
        "shard": ("sweep", [f"--config={CONFIGS / 'digits_sweep.py'}:tiny",
                            f"--sweep_dir={out}", "--shard=3/2"], "--shard=3/2"),
    }[case]
    if case == "dataset":
        pytest.importorskip("tensorflow_datasets")
    rc, lines, _ = _cli(module, *args)
    assert rc == cli.USER_ERROR_EXIT, lines
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], lines
    assert not (tmp_path / "new").exists()


def test_verbose_keeps_the_traceback(tmp_path):
    rc, lines, _ = _cli("main", f"--config={CONFIGS / 'digits_mlp.py'}:tiny",
                        f"--workdir={tmp_path / 'w'}", "--config.optim.learning_rate=-1",
                        env={cli.VERBOSE_ENV: "1"})
    assert rc != 0 and any(line.startswith("Traceback") for line in lines)
    assert "config.optim.learning_rate" in lines[-1]


def test_bugs_keep_their_traceback_and_user_errors_do_not(tmp_path, monkeypatch, capsys):
    from experiments.configs import base

    monkeypatch.delenv(cli.VERBOSE_ENV, raising=False)

    def bug(_):
        return np.zeros(3).reshape(2, 2)  # a ValueError raised inside numpy: a bug

    with pytest.raises(ValueError, match="reshape"):
        cli.guarded(bug)([])

    def user_error(_):
        return base.parse_arg("tinny")  # a ValueError raised on purpose by our code

    with pytest.raises(SystemExit) as code:
        cli.guarded(user_error)([])
    assert code.value.code == cli.USER_ERROR_EXIT
    assert capsys.readouterr().err.startswith("error: unknown config argument 'tinny'")


def test_empty_directories_of_a_failed_command_are_removed(tmp_path):
    kept = tmp_path / "kept"
    (kept / "sub").mkdir(parents=True)
    (kept / "sub" / "file").write_text("x")
    paths.remove_if_empty(str(kept))
    assert (kept / "sub" / "file").exists()
    empty = tmp_path / "empty"
    (empty / "a" / "b").mkdir(parents=True)
    paths.remove_if_empty(str(empty))
    assert not empty.exists()


def test_sweep_store_creates_nothing_until_it_writes(tmp_path):
    store = SweepStore(str(tmp_path / "sweep"))
    assert store.records() == [] and not (tmp_path / "sweep").exists()
    store.append([_result(0)])
    [part] = (tmp_path / "sweep" / "trials.d").iterdir()
    assert part.name.endswith(".jsonl") and "-t0-" in part.name


# ----------------------------------------------------------------------------- 8. small ones

def test_noise_exact_names_a_nan_input():
    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    params = {"w": jnp.ones(3)}
    x, y = np.ones((8, 3), np.float32), np.ones(8, np.float32)
    x[5, 1] = np.nan
    with pytest.raises(ValueError, match=r"batch leaf 'x' holds NaN \(first at example 5\)"):
        noise.exact(loss_fn, params, {"x": x, "y": y})
    with pytest.raises(ValueError, match=r"params leaf 'w' holds inf"):
        noise.exact(loss_fn, {"w": jnp.array([1.0, jnp.inf, 1.0])},
                    {"x": np.ones((8, 3), np.float32), "y": y})


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "cbs" / "configs").glob("*.py")
                                        if p.stem not in ("__init__", "base")
                                        and "def get_config" in p.read_text()))
def test_every_config_rejects_an_unknown_argument_word(name):
    import importlib

    module = importlib.import_module(f"experiments.configs.{name}")
    with pytest.raises(ValueError, match=r"unknown config argument 'tinny'.*known: (\w+, )*tiny\b"):
        module.get_config("tinny")
    module.get_config("tiny")  # the known word still works


def test_ramp_directories_have_no_spaces(tmp_path):
    labels = ["step (Llama 3)", "linear (DeepSeek-V3)", "adaptive", "fixed B=16"]
    names = [ramps.run_dir_name(label) for label in labels]
    assert names == ["step_llama_3", "linear_deepseek-v3", "adaptive", "fixed_b_16"]
    assert not any(" " in n or "(" in n for n in names)
    legacy = tmp_path / ramps.RAMPS_DIR / "step (Llama 3)"  # an older sweep's run is resumed
    legacy.mkdir(parents=True)
    assert ramps._run_dir(str(tmp_path), "step (Llama 3)") == str(legacy)
    assert ramps._run_dir(str(tmp_path), "adaptive") == str(tmp_path / ramps.RAMPS_DIR /
                                                             "adaptive")
    from cbs.configs import digits_ramps  # labels that clash are refused when validated

    c = digits_ramps.get_config("tiny")
    runs = [dict(r) for r in c.ramps][:2]
    runs[0]["label"], runs[1]["label"] = "a b", "a_b"
    c.ramps = runs
    with pytest.raises(ValueError, match="clashing directory names"):
        ramps.validate_ramps(c, replicas=1)


@pytest.mark.parametrize("targets", [(-1.0,), (0.5, 0.0), (float("inf"),), (True,),
                                     ("0.5",), (0.5, float("nan"))])
def test_sweep_targets_must_be_reachable_losses(targets):
    from cbs.sweeps import grid

    c = digits_sweep.get_config("tiny")
    c.sweep.targets = targets
    with pytest.raises(ValueError, match=r"^config\.sweep\.targets: must be "):
        grid.validate_sweep(c.sweep)
