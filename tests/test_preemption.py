"""cbs.engine.preemption: a real SIGTERM sent to a running command saves a checkpoint, leaves
status.json at "preempted" and exits with status 143; rerunning the same command resumes and
ends with records equal to an uninterrupted run's (timing fields aside)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from conftest import SUBPROCESS_XLA_FLAGS

from cbs.engine import preemption
from cbs.results import files, records
from cbs.results.store import SweepStore

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "experiments" / "configs"
_TIMING = ("elapsed", "seconds", "perf/", "time")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {SUBPROCESS_XLA_FLAGS}")


def _start(module: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lines(path: pathlib.Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def _terminate_when(proc: subprocess.Popen, ready, timeout: float = 300):
    """Sends SIGTERM once `ready()` holds; returns (exit status, stderr lines)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the command never got going"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, [line for line in err.splitlines() if line.strip()]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)


def _strip(recs):
    return [{k: v for k, v in r.items() if not any(t in k for t in _TIMING)} for r in recs]


def test_check_raises_after_a_request():
    preemption.clear()
    preemption.check("nowhere")  # nothing requested: returns
    preemption.request()
    try:
        with pytest.raises(preemption.Preempted, match="rerun the same command"):
            preemption.check("between groups")
    finally:
        preemption.clear()


def test_sigterm_during_training_checkpoints_and_the_rerun_resumes_exactly(tmp_path):
    args = [f"--config={CONFIGS / 'digits_mlp.py'}:tiny", "--config.train.max_steps=300",
            "--config.train.checkpoint_every=1000", "--config.eval.every=50",
            "--config.noise.every=0"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    proc = _start("experiments.main", *args, f"--workdir={cut}")
    code, errors = _terminate_when(proc, lambda: _lines(cut / "metrics.jsonl") >= 4)
    assert code == preemption.EXIT_STATUS, errors[-20:]
    assert len(errors) == 1 and errors[0].startswith("preempted: "), errors
    status = json.loads((cut / "status.json").read_text())
    assert status["status"] == "preempted" and 0 < status["step"] < 300
    assert status["checkpoint_step"] == status["step"]

    again = _run("experiments.main", *args, f"--workdir={cut}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((cut / "status.json").read_text())["status"] == "finished"
    first = _run("experiments.main", *args, f"--workdir={full}")
    assert first.returncode == 0, first.stderr[-3000:]
    read = lambda d: _strip(records.read_records(str(d / files.METRICS_FILE)))
    assert read(cut) == read(full)


@pytest.mark.slow
def test_sigterm_during_a_sweep_keeps_its_records_and_the_rerun_finishes_it(tmp_path):
    args = [f"--config={CONFIGS / 'digits_sweep.py'}:tiny", "--noanalyze"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    proc = _start("experiments.sweep", *args, f"--sweep_dir={cut}")
    finished = lambda: len(SweepStore(str(cut)).records())
    code, errors = _terminate_when(proc, lambda: finished() >= 1)
    assert code == preemption.EXIT_STATUS, errors[-20:]
    assert errors[-1].startswith("preempted: "), errors
    assert finished() >= 1
    assert _run("experiments.sweep", *args, f"--sweep_dir={cut}").returncode == 0
    assert _run("experiments.sweep", *args, f"--sweep_dir={full}").returncode == 0
    read = lambda d: _strip(SweepStore(str(d)).records())
    assert read(cut) == read(full)
