"""Two local processes (jax.distributed on 127.0.0.1, CPU collectives) equal one process.

Each worker (tests/multihost_worker.py) has 2 fake CPU devices; together they form one
4-device mesh and train the same run as this process does on 4 of its 8 fake devices.
The parameters agree to float32 round-off (the cross-process all-reduce may sum in another
order), and process 0 alone wrote the records.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import _warm
import jax
import numpy as np
import pytest
from conftest import SUBPROCESS_XLA_FLAGS

from cbs.engine import config as config_lib
from cbs.engine import loop, trainer
from cbs.results import files, records
from cbs.runtime import mesh as mesh_lib

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_worker.py")


def worker_config(steps: int = 6, full: bool = True):
    """digits MLP, B = 32 over 4 replicas of m = 4 (A = 2); `full` adds evaluation and exact
    noise measurements (two more programs to compile in each process)."""
    c = config_lib.default_config()
    c.model.hidden_sizes = (16,)
    c.batch.micro_batch = 4
    c.batch.schedule.batch_size = 32
    c.train.max_steps = steps or 6
    c.train.log_every = 2
    c.train.checkpoint_every = 3
    c.train.progress_bar = False
    c.train.tensorboard = False
    c.eval.enabled = full
    c.eval.every = 3
    c.eval.batch_size = 512
    c.noise.every = 3 if full else 0
    return c


def lm_worker_config(steps: int = 6):
    """The tiny scanned LM (remat, FSDP × TP on a 2 × 2 mesh), B = 32 sequences of 16 over 2
    data replicas of m = 8 (A = 2), throughput records on."""
    from experiments.configs import lm_shakespeare

    c = lm_shakespeare.get_config("tiny")
    c.data.options.seq_len = 16
    c.mesh.model = 2
    c.batch.micro_batch = 8
    c.batch.schedule.batch_size = 32
    c.train.max_steps = steps or 6
    c.train.log_every = 2
    c.train.checkpoint_every = 3
    c.train.tensorboard = False
    c.eval.enabled = False
    c.noise.every = 0
    return c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(workdir, out, num_processes: int, devices: int, steps: int = 6,
            full: bool = True, lm: bool = False):
    """Starts the workers; with `lm` they train the tiny LM and find each other from a
    simulated Slurm step (coordinator port 61440 + job id mod 4096) instead of flags."""
    port = _free_port() if not lm else _free_port_in(61440, 65535)
    env = _warm.base_env() | {"XLA_FLAGS": SUBPROCESS_XLA_FLAGS}
    slurm = lambda i: {"SLURM_JOB_ID": str(port - 61440), "SLURM_STEP_NODELIST": "127.0.0.1",
                       "SLURM_NTASKS": str(num_processes), "SLURM_PROCID": str(i),
                       "SLURM_LOCALID": str(i)} if lm else {}
    procs = [_warm.popen(
        [WORKER, f"--process_id={i}", f"--num_processes={num_processes}",
         f"--port={port}", f"--devices={devices}", f"--workdir={workdir}", f"--out={out}",
         f"--steps={steps}", f"--full={int(full)}", f"--lm={int(lm)}", f"--auto={int(lm)}"],
        env=env | slurm(i), stderr_to_stdout=True) for i in range(num_processes)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-3000:]
    return outputs


def _free_port_in(lo: int, hi: int) -> int:
    start = os.getpid() % (hi - lo)
    for i in range(hi - lo):
        port = lo + (start + i) % (hi - lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in [{lo}, {hi})")


def _two_processes_equal_one(tmp_path, full: bool, lm: bool = False):
    out = tmp_path / "params.npz"
    outputs = _launch(tmp_path / "multi", out, num_processes=2, devices=2, full=full, lm=lm)
    assert "summary finished 6" in outputs[0]
    multi = dict(np.load(out))

    config = lm_worker_config() if lm else worker_config(full=full)
    mesh = mesh_lib.make_mesh(config.mesh.data, config.mesh.model, devices=jax.devices()[:4])
    tr = trainer.Trainer(config, str(tmp_path / "single"), mesh=mesh)
    run = loop.Loop(tr)
    run.run()
    single = {jax.tree_util.keystr(k): np.asarray(v)
              for k, v in jax.tree_util.tree_flatten_with_path(run.state.params)[0]}
    assert single.keys() == multi.keys()
    for k in single:
        np.testing.assert_allclose(multi[k], single[k], rtol=2e-5, atol=1e-6, err_msg=k)
    r_multi = records.read_records(str(tmp_path / "multi" / files.METRICS_FILE))
    r_single = records.read_records(str(tmp_path / "single" / files.METRICS_FILE))
    assert [r["step"] for r in r_multi] == [r["step"] for r in r_single]
    for a, b in zip(r_multi, r_single, strict=True):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if isinstance(v, float) and not k.startswith("perf/"):  # timings differ
                np.testing.assert_allclose(v, b[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert sorted(os.listdir(tmp_path / "multi" / "checkpoints")) == ["3", "6"]


def test_two_processes_equal_one(tmp_path):
    """Training, the two-batch estimate, checkpoints and records (process 0 only)."""
    _two_processes_equal_one(tmp_path, full=False)


# Slow; by default test_two_processes_equal_one (two processes), test_lm's FSDP × TP step and
# test_distributed's Slurm join cover its parts.
@pytest.mark.slow
def test_two_processes_train_the_tiny_lm_like_one(tmp_path):
    """The scanned LM with FSDP × TP across two processes that join from a (simulated) Slurm
    environment, no flags: same parameters and records as one process on 4 devices."""
    _two_processes_equal_one(tmp_path, full=False, lm=True)


@pytest.mark.slow
def test_two_processes_equal_one_with_evaluation_and_measurements(tmp_path):
    _two_processes_equal_one(tmp_path, full=True)


@pytest.mark.slow
def test_kill_minus_nine_then_rerun_is_bit_identical(tmp_path):
    """A real SIGKILL in the middle of a run, then the same command: same params, records."""
    import signal
    import time

    whole, broken = tmp_path / "whole", tmp_path / "broken"
    cmd = [sys.executable, WORKER, "--num_processes=1", "--devices=1", "--steps=60", "--full=1",
           f"--workdir={broken}", f"--out={tmp_path / 'broken.npz'}"]
    env = dict(os.environ, XLA_FLAGS=SUBPROCESS_XLA_FLAGS)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    records_path = broken / files.METRICS_FILE
    while time.time() < deadline and (not records_path.exists() or len(
            records.read_records(str(records_path))) < 20):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert records.read_json(str(broken / files.STATUS_FILE))["status"] == "running"
    _launch(broken, tmp_path / "broken.npz", num_processes=1, devices=1, steps=60)
    _launch(whole, tmp_path / "whole.npz", num_processes=1, devices=1, steps=60)
    r_whole = records.read_records(str(whole / files.METRICS_FILE))
    assert records.read_records(str(records_path)) == r_whole
    a, b = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "broken.npz")
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k])
