"""cbs.results.writers: the one metric-writer interface (clu's `write_scalars(step, scalars)`)
and its back ends, each read back from what it wrote: JSON lines, TensorBoard event files,
a W&B run in offline mode (its `.wandb` file); a run's records mirrored to them; and
`NoiseMonitor` writing through one."""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import sys
import time

import jax.numpy as jnp
import ml_collections
import pytest
from conftest import SUBPROCESS_XLA_FLAGS

from cbs import noise
from cbs.engine import loop
from cbs.engine import trainer as trainer_lib
from cbs.results import files, records
from cbs.results.writers import (
    JsonlWriter,
    MetricWriter,
    MultiWriter,
    TensorBoardWriter,
    WandbWriter,
    record_scalars,
)
from cbs.runtime import fields, writer
from cbs.stats.noise import NoiseStats


class _Recorder(MetricWriter):
    def __init__(self):
        self.calls: list[tuple] = []

    def write_scalars(self, step, scalars):
        self.calls.append(("scalars", step, dict(scalars)))

    def write_hparams(self, hparams):
        self.calls.append(("hparams", dict(hparams)))

    def flush(self):
        self.calls.append(("flush",))


def _tensorboard_scalars(logdir) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in the event files under `logdir` (TFRecord framing:
    length, its CRC, the event proto, its CRC)."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        data = open(path, "rb").read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            out += [(event.step, v.tag, v.simple_value) for v in event.summary.value
                    if v.WhichOneof("value") == "simple_value"]
    return out


def _wandb_history(run_dir, timeout: float = 60.0) -> list[dict]:
    """The history rows of an offline W&B run, read from its `.wandb` file (a LevelDB-style log:
    a 7-byte file header, then 32 KiB blocks of chunks, each with a 7-byte header (CRC,
    length, type: 1 full, 2 first, 3 middle, 4 last) and a piece of a `Record` proto). W&B's
    service process may still be writing it when the run has finished: read until the run's
    exit record is there."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    deadline = time.monotonic() + timeout
    while True:
        data, block, i, rows, pending, ended = open(path, "rb").read(), 32768, 7, [], b"", False
        while i + 7 <= len(data):
            if block - i % block < 7:  # a block's tail too short for a header is padding
                i += block - i % block
                continue
            length, kind = struct.unpack("<HB", data[i + 4:i + 7])
            pending += data[i + 7:i + 7 + length]
            i += 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record.FromString(pending)
                pending, which = b"", record.WhichOneof("record_type")
                ended |= which == "exit"
                if which == "history":
                    rows.append({item.key or "/".join(item.nested_key):
                                 json.loads(item.value_json) for item in record.history.item})
        if ended or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_record_scalars_are_the_numeric_namespaced_fields_a_trial_apart():
    rec = {"step": 3, "kind": "eval", "trial": 2, "eval/loss": 0.5, "noise/b_simple": None,
           "data/examples_seen": 96, "opt/ok": True, "name/x": "text"}
    assert record_scalars(rec) == (3, {"eval/loss/trial2": 0.5,
                                       "data/examples_seen/trial2": 96.0})
    assert record_scalars({"step": 1, "train/loss": jnp.float32(2.5)}) == (
        1, {"train/loss": 2.5})


def test_jsonl_and_multi_writers_write_what_they_are_given(tmp_path):
    rec = _Recorder()
    with MultiWriter([JsonlWriter(tmp_path), rec]) as w:
        w.write_hparams({"lr": 0.1})
        w.write_scalars(0, {"a/x": 1.0, "b": jnp.asarray(2)})
        w.write_scalars(5, {"a/x": 0.5})
    assert records.read_records(str(tmp_path / files.METRICS_FILE)) == [
        {"step": 0, "a/x": 1.0, "b": 2}, {"step": 5, "a/x": 0.5}]
    assert rec.calls == [("hparams", {"lr": 0.1}), ("scalars", 0, {"a/x": 1.0, "b": 2}),
                         ("scalars", 5, {"a/x": 0.5}), ("flush",)]  # close: flush
    with JsonlWriter(tmp_path, start_step=5) as w:  # a resume at step 5 drops what follows
        w.write_scalars(6, {"a/x": 0.25})
    assert [r["step"] for r in records.read_records(str(tmp_path / files.METRICS_FILE))] == [
        0, 6]


def test_tensorboard_writer_events_read_back(tmp_path):
    with TensorBoardWriter(tmp_path) as w:
        w.write_scalars(2, {"train/loss": 1.5, "flag": True, "text": "x"})
        w.write_scalars(4, {"train/loss": 0.75})
        w.write_hparams({"lr": 0.1})
    assert _tensorboard_scalars(tmp_path) == [(2, "train/loss", 1.5), (4, "train/loss", 0.75)]


def test_a_runs_records_stay_byte_identical_and_are_mirrored(tmp_path):
    """metrics.jsonl holds exactly json.dumps of each record (the record of truth, unchanged
    by the mirrors); the mirrors get each record's numeric fields at its step."""
    recs = [{"step": 0, "kind": "train", "train/loss": 2.0, "data/examples_seen": 0},
            {"step": 1, "kind": "train", "train/loss": jnp.float32(1.5),
             "data/examples_seen": 32},
            {"step": 1, "kind": "eval", "eval/loss": 1.25, "note": "x"}]
    w = writer.MetricsWriter(tmp_path, progress=False, tensorboard=True)
    rec = _Recorder()
    w.mirrors.writers.append(rec)
    w.write(recs[:2])
    w.sync()
    w.write(recs[2:])
    w.close()
    text = (tmp_path / files.METRICS_FILE).read_text()
    plain = [{k: float(v) if hasattr(v, "dtype") else v for k, v in r.items()} for r in recs]
    assert text == "".join(json.dumps(r) + "\n" for r in plain)
    assert [c for c in rec.calls if c[0] == "scalars"] == [
        ("scalars", 0, {"train/loss": 2.0, "data/examples_seen": 0.0}),
        ("scalars", 1, {"train/loss": 1.5, "data/examples_seen": 32.0}),
        ("scalars", 1, {"eval/loss": 1.25})]
    assert ("flush",) in rec.calls
    assert _tensorboard_scalars(tmp_path / writer.TENSORBOARD_DIR)[-1] == (1, "eval/loss", 1.25)


def test_noise_monitor_writes_through_a_writer(tmp_path):
    f = lambda v: jnp.asarray(v, jnp.float32)
    stats = NoiseStats(batch_size=8, mean_grad_sq_norm=f(4.0), grad_sq_norm=f(4.0),
                       trace_sigma=f(8.0), b_simple=f(2.0))
    logged = []
    with JsonlWriter(tmp_path) as w:
        monitor = noise.NoiseMonitor(decay=0.5, every=2, writer=w,
                                     log=lambda s, v: logged.append((s, v)))
        for step in range(100, 105):
            monitor.update(stats, step=step)
    written = records.read_records(str(tmp_path / files.METRICS_FILE))
    assert [r["step"] for r in written] == [101, 103] == [s for s, _ in monitor.history]
    assert set(written[0]) == {"step", *logged[0][1]}
    assert written[0]["noise/ema_b_simple"] == logged[0][1]["noise/ema_b_simple"]
    assert written[1]["noise/ema_b_simple"] == pytest.approx(8.0 / 4.0)
    assert math.isnan(written[1]["noise/ema_b_noise"])  # never fed curvature
    with pytest.raises(TypeError, match="write_scalars"):
        noise.NoiseMonitor(writer=print)


def test_missing_wandb_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r'pip install -e "\.\[wandb\]"'):
        WandbWriter("project")
    with pytest.raises(ImportError, match=r'config\.train\.wandb needs wandb: .*\[wandb\]'):
        writer.MetricsWriter(tmp_path, progress=False, wandb="project")
    assert not (tmp_path / files.METRICS_FILE).exists()  # checked before any file


def test_wandb_setting_is_validated_and_counts_in_the_hash_only_when_set():
    from test_train import tiny_config

    c = tiny_config()
    bad = ml_collections.ConfigDict(c.to_dict() | {"train": c.train.to_dict() | {"wandb": True}})
    with pytest.raises(fields.ConfigError, match=r"config\.train\.wandb: must be a W&B project"):
        loop.validate_train_config(bad.train)
    with pytest.raises(fields.ConfigError, match=r"config\.train\.wandb"):
        writer.Outputs.from_config(bad)
    without = tiny_config()
    del without.train["wandb"]  # a config from before the field: the same hash
    assert loop.config_hash(c) == loop.config_hash(without)
    assert loop.config_hash(tiny_config(**{"train.wandb": "p"})) != loop.config_hash(c)


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B in offline mode (no network, no account), its files under tmp_path/wandb."""
    pytest.importorskip("wandb")
    for k in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path / "wandb"


def test_wandb_writer_history_reads_back_and_a_resume_continues_the_run(tmp_path,
                                                                       offline_wandb):
    """A run's records through `MetricsWriter(wandb=...)`: the offline run's history is their
    numeric fields at their steps (several records at one step are one row; a trial's keys
    apart); the same run directory resumed logs into the same W&B run from its step on."""
    workdir = tmp_path / "run"
    w = writer.MetricsWriter(workdir, progress=False, wandb="cbs-test", hparams={"lr": 0.1})
    w.write([{"step": 0, "kind": "train", "train/loss": 2.0},
             {"step": 1, "kind": "train", "train/loss": 1.5}])
    w.write([{"step": 1, "kind": "eval", "trial": 3, "eval/loss": 1.25, "eval/ok": True}])
    w.write([{"step": 0, "kind": "train", "train/loss": 9.0}])  # below the last step: dropped
    w.close()
    run_id = json.loads((workdir / files.WANDB_RUN_FILE).read_text())["id"]
    (first,) = glob.glob(str(offline_wandb / f"offline-run-*-{run_id}"))
    assert [{k: v for k, v in r.items() if not k.startswith("_") or k == "_step"}
            for r in _wandb_history(first)] == [
        {"_step": 0, "train/loss": 2.0},
        {"_step": 1, "train/loss": 1.5, "eval/loss/trial3": 1.25}]
    resumed = writer.MetricsWriter(workdir, start_step=1, progress=False, wandb="cbs-test")
    resumed.write([{"step": 1, "kind": "train", "train/loss": 1.4}])
    resumed.close()
    # a resume within the same second is written to `<first>-1`: match that name too
    runs = glob.glob(str(offline_wandb / f"offline-run-*-{run_id}*"))
    (second,) = set(runs) - {first}  # the same W&B run id (`wandb sync` merges the two)
    assert [r["train/loss"] for r in _wandb_history(second)] == [1.4]
    fresh = writer.MetricsWriter(tmp_path / "other", progress=False, wandb="cbs-test")
    fresh.close()
    assert json.loads((tmp_path / "other" / files.WANDB_RUN_FILE).read_text())["id"] != run_id


@pytest.mark.slow
def test_a_run_mirrors_its_records_to_an_offline_wandb_run(tmp_path, offline_wandb):
    """config.train.wandb: the run's train and eval records are the W&B run's history (its
    offline `.wandb` file, read back), and a resumed run continues the same W&B run. Fast
    equivalent: the test above."""
    from test_train import one_device_mesh, tiny_config

    workdir = tmp_path / "run"
    c = tiny_config(**{"train.wandb": "cbs-test", "train.max_steps": 8})
    trainer_lib.run(c, str(workdir), mesh=one_device_mesh())
    run_id = json.loads((workdir / files.WANDB_RUN_FILE).read_text())["id"]
    (run_dir,) = glob.glob(str(offline_wandb / f"offline-run-*-{run_id}"))
    rows = _wandb_history(run_dir)
    recs = records.read_records(str(workdir / files.METRICS_FILE))
    for kind, key in (("train", "train/loss"), ("eval", "eval/loss")):
        logged = {r["_step"]: r[key] for r in rows if key in r}
        assert logged == {r["step"]: r[key] for r in recs if r["kind"] == kind}, key
    assert len({r["_step"] for r in rows}) == 9  # steps 0..8

    c.train.max_steps = 12  # longer: resumes from the checkpoint at step 8
    trainer_lib.run(c, str(workdir), mesh=one_device_mesh())
    assert json.loads((workdir / files.WANDB_RUN_FILE).read_text())["id"] == run_id
    runs = sorted(glob.glob(str(offline_wandb / f"offline-run-*-{run_id}*")))
    assert len(runs) == 2  # the same W&B run, resumed (wandb sync merges them)
    later = {r["_step"] for r in _wandb_history(runs[1]) if "train/loss" in r}
    assert later == {8, 9, 10, 11}


def test_a_sweep_mirrored_to_wandb_says_one_line_per_run_and_sends_its_b_crit_table(tmp_path):
    """A three-group tiny sweep with `train.wandb` (offline): W&B's own banners are silenced
    (they were 102 `wandb:` lines on stderr), one line per run names where it is, and the
    sweep's B_crit table goes to W&B as a "<sweep> summary" run of the sweep's group."""
    import _warm

    env = _warm.base_env() | {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
                              "XLA_FLAGS": SUBPROCESS_XLA_FLAGS}
    env.pop("WANDB_SILENT", None)  # what W&B would print is the point
    done = _warm.python(["-m", "experiments.sweep",
                         "--config=experiments/configs/digits_sweep.py:tiny",
                         f"--sweep_dir={tmp_path / 'sw'}", "--config.train.wandb=cbs-test"],
                        env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("wandb:")]
    groups = len(os.listdir(tmp_path / "sw" / "groups"))
    assert groups == 3 and len(said) == groups + 1, said
    assert said[-1].startswith("wandb: sw summary (offline: ")
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")), key=os.path.getmtime)
    rows = _wandb_history(runs[-1])
    assert any(k.startswith("sweep/b_crit/") for r in rows for k in r), rows  # the table
