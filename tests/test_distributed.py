"""cbs.runtime.distributed: detection from the environment, explicit flags as the override,
and a real auto-detected start: two local processes under a simulated Slurm step."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from cbs.runtime import distributed

SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[001-002]", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}


def test_detect():
    assert distributed.detect({}) is None
    assert distributed.detect(SLURM) == "slurm"
    assert distributed.detect(SLURM | {"SLURM_NTASKS": "1"}) is None  # one task: nothing
    assert distributed.detect({"OMPI_COMM_WORLD_SIZE": "4"}) == "ompi"
    assert distributed.detect({"TPU_WORKER_HOSTNAMES": "t1,t2"}) == "tpu"
    assert distributed.detect({"TPU_WORKER_HOSTNAMES": "localhost"}) is None  # one TPU VM


def test_single_process_and_incomplete_flags(monkeypatch):
    for k in SLURM | {"OMPI_COMM_WORLD_SIZE": "", "TPU_WORKER_HOSTNAMES": ""}:
        monkeypatch.delenv(k, raising=False)
    assert distributed.initialize() == "single"
    with pytest.raises(ValueError, match="--num_processes"):
        distributed.initialize("127.0.0.1:1234", None, 0)


_CHILD = """
import os, sys
sys.path.insert(0, {root!r})
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
from cbs.runtime import distributed
how = distributed.initialize(timeout_s=60)
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")),
                                           jnp.full((2,), jax.process_index() + 1.0))
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
print(how, jax.process_index(), jax.process_count(), jax.device_count(), float(total))
distributed.shutdown()
"""


def _free_slurm_job_id() -> int:
    """A job id whose derived coordinator port (61440 + id mod 4096) is free now."""
    for job in range(os.getpid() % 4096, os.getpid() % 4096 + 4096):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 61440 + job % 4096))
                return job
            except OSError:
                continue
    raise RuntimeError("no free port in the Slurm range")


def test_two_processes_find_each_other_from_a_slurm_environment():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    job = _free_slurm_job_id()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(root=root)],
        env=env | {"SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "127.0.0.1",
                   "SLURM_NTASKS": "2", "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, out[-3000:]
        # 2 processes × 2 devices; the global sum sees both processes' data: 2·1 + 2·2.
        assert out.strip().splitlines()[-1] == f"slurm {i} 2 4 6.0"


def test_modes(monkeypatch):
    """--distributed: off never joins (explicit flags contradict it); on refuses to run alone;
    auto runs alone when there is nothing to join."""
    for k in SLURM | {"OMPI_COMM_WORLD_SIZE": "", "TPU_WORKER_HOSTNAMES": ""}:
        monkeypatch.delenv(k, raising=False)
    assert distributed.initialize(mode="auto") == "single"
    assert distributed.initialize(mode="off") == "off"
    for k, v in SLURM.items():
        monkeypatch.setenv(k, v)
    assert distributed.initialize(mode="off") == "off"  # a Slurm step, but each task alone
    with pytest.raises(ValueError, match="contradicts --coordinator_address"):
        distributed.initialize("127.0.0.1:1234", 2, 0, mode="off")
    for k in SLURM:
        monkeypatch.delenv(k)
    with pytest.raises(ValueError, match="--distributed=on: no multi-process environment"):
        distributed.initialize(mode="on")
    with pytest.raises(ValueError, match="must be one of auto, on, off"):
        distributed.initialize(mode="yes")


def test_one_shard_per_host():
    """--shard=auto is this host's index among the hosts of its TPU slice, Slurm step or Open
    MPI launch, and needs a runtime per host (not --distributed=on)."""
    tpu = {"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3", "TPU_WORKER_ID": "2"}
    assert distributed.host_shard(tpu) == "2/4"
    assert distributed.host_shard(SLURM) == "1/2"
    assert distributed.host_shard({"OMPI_COMM_WORLD_SIZE": "8",
                                   "OMPI_COMM_WORLD_RANK": "5"}) == "5/8"
    assert distributed.host_shard({}) is None
    assert distributed.resolve_shard("auto", "off", tpu) == "2/4"
    assert distributed.resolve_shard("1/3", "on", tpu) == "1/3"
    assert distributed.resolve_shard(None, "auto", {}) is None
    with pytest.raises(ValueError, match="use --distributed=off"):
        distributed.resolve_shard("auto", "on", tpu)
    with pytest.raises(ValueError, match="give --shard=i/n"):
        distributed.resolve_shard("auto", "off", {})


def test_a_sweep_command_with_shard_auto_and_distributed_on_is_one_line(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu",
               TPU_WORKER_HOSTNAMES="t0,t1", TPU_WORKER_ID="1")
    out = subprocess.run(
        [sys.executable, "-m", "experiments.sweep",
         f"--config={root}/experiments/configs/digits_sweep.py:tiny", "--shard=auto",
         "--distributed=on", f"--sweep_dir={tmp_path / 's'}"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "error: --shard=auto runs one shard per host: use --distributed=off (or auto), not on"]
    assert not (tmp_path / "s").exists()
