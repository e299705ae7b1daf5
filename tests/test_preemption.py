"""cbs.runtime.preemption: a real SIGTERM sent to a running command saves a checkpoint, leaves
status.json at "preempted" and exits with status 143; a real SIGINT (Ctrl-C) does the same with
"interrupted" and 130; rerunning the same command resumes and ends with records equal to an
uninterrupted run's (timing fields aside). Two processes of one run (jax.distributed on
127.0.0.1) stop at one step when only one of them gets the SIGTERM."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import time

import _warm
import pytest
from conftest import SUBPROCESS_XLA_FLAGS

from cbs.engine import loop
from cbs.results import files, records
from cbs.results.store import SweepStore
from cbs.runtime import preemption

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "experiments" / "configs"
_TIMING = ("elapsed", "seconds", "perf/", "time")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {SUBPROCESS_XLA_FLAGS}")


def _start(module: str, *args: str) -> subprocess.Popen:
    return _warm.popen(["-m", module, *args], env=_env())


def _lines(path: pathlib.Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def _terminate_when(proc: subprocess.Popen, ready, timeout: float = 300,
                    sig: int = signal.SIGTERM):
    """Sends `sig` once `ready()` holds; returns (exit status, stderr lines)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the command never got going"
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, [line for line in err.splitlines() if line.strip()]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return _warm.python(["-m", module, *args], env=_env(), timeout=600)


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


_TRAIN_ARGS = [f"--config={CONFIGS / 'digits_mlp.py'}:tiny", "--config.train.max_steps=300",
               "--config.train.checkpoint_every=1000", "--config.eval.every=50",
               "--config.noise.every=0"]


def _metrics(workdir: pathlib.Path):
    return _strip(records.read_records(str(workdir / files.METRICS_FILE)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The records of the run the stopped ones are compared with."""
    full = tmp_path_factory.mktemp("full")
    first = _run("experiments.main", *_TRAIN_ARGS, f"--workdir={full}")
    assert first.returncode == 0, first.stderr[-3000:]
    return _metrics(full)


def _signal_during_training(tmp_path: pathlib.Path, sig: int) -> pathlib.Path:
    """SIGTERM: "preempted", 143; SIGINT (Ctrl-C): "interrupted", 130; stderr <= 3 lines; a
    checkpoint at the step it stopped. Returns the run directory."""
    status_name = "preempted" if sig == signal.SIGTERM else "interrupted"
    cut = tmp_path / "cut"
    proc = _start("experiments.main", *_TRAIN_ARGS, f"--workdir={cut}")
    code, errors = _terminate_when(proc, lambda: _lines(cut / "metrics.jsonl") >= 4, sig=sig)
    assert code == 128 + sig, errors[-20:]
    assert len(errors) <= 3 and errors[-1].startswith(f"{status_name}: "), errors
    status = json.loads((cut / "status.json").read_text())
    assert status["status"] == status_name and 0 < status["step"] < 300
    assert status["checkpoint_step"] == status["step"]
    return cut


def _rerun_resumes_exactly(cut: pathlib.Path, uninterrupted) -> None:
    again = _run("experiments.main", *_TRAIN_ARGS, f"--workdir={cut}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((cut / "status.json").read_text())["status"] == "finished"
    assert _metrics(cut) == uninterrupted


def test_sigterm_during_training_checkpoints_and_the_rerun_resumes_exactly(tmp_path,
                                                                          uninterrupted):
    _rerun_resumes_exactly(_signal_during_training(tmp_path, signal.SIGTERM), uninterrupted)


def test_sigint_during_training_checkpoints_as_interrupted(tmp_path):
    cut = _signal_during_training(tmp_path, signal.SIGINT)
    # a rerun resumes it: the loop ends at once only on the ended statuses
    assert json.loads((cut / "status.json").read_text())["status"] not in loop.ENDED


# Slow (a fourth run of the command): the stop on SIGINT is checked above, and the rerun of a
# stopped run (the same checkpoint, whichever signal wrote it) by the SIGTERM test.
@pytest.mark.slow
def test_sigint_during_training_then_the_rerun_resumes_exactly(tmp_path, uninterrupted):
    _rerun_resumes_exactly(_signal_during_training(tmp_path, signal.SIGINT), uninterrupted)


def test_sigint_during_a_sweep_saves_the_running_group_in_one_line(tmp_path):
    """Ctrl-C while a sweep's first group trains: its checkpoint and status "interrupted",
    exit status 130, at most 3 lines on stderr besides the progress bars' lines (the
    `interrupt:` notice and the final line)."""
    cut = tmp_path / "cut"
    proc = _start("experiments.sweep", f"--config={CONFIGS / 'digits_sweep.py'}:tiny",
                  "--noanalyze", f"--sweep_dir={cut}")
    running = lambda: any(cut.glob("groups/*/status.json"))
    code, errors = _terminate_when(proc, running, sig=signal.SIGINT)
    assert code == preemption.INTERRUPT_EXIT_STATUS, errors[-20:]
    errors = [e for e in errors if not re.search(r"\d+%\|", e)]  # tqdm's lines off a terminal
    assert len(errors) <= 3 and errors[-1].startswith("interrupted: "), errors
    statuses = [json.loads(p.read_text()) for p in cut.glob("**/status.json")]
    assert [s["status"] for s in statuses] == ["interrupted"], statuses
    assert statuses[0]["checkpoint_step"] == statuses[0]["step"]


def test_a_second_sigint_stops_at_once_and_one_outside_training_is_a_keyboard_interrupt():
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    preemption.clear()
    try:
        assert preemption.install()
        with pytest.raises(KeyboardInterrupt):  # outside training: the usual effect
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert not preemption.requested()
        with preemption.active():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        assert preemption.requested() and preemption.status() == "interrupted"
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL  # the next one kills
        with pytest.raises(preemption.Preempted) as stopped:
            preemption.check("between groups")
        assert stopped.value.exit_status == 130 and stopped.value.status == "interrupted"
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
        preemption.clear()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(workdir: pathlib.Path, *args: str) -> list[subprocess.Popen]:
    port = _free_port()
    env = _env()  # one CPU device per process: a mesh of 2 data replicas over 2 processes
    return [_warm.popen(
        ["-m", "experiments.main", *args, f"--workdir={workdir}",
         f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"],
        env=env) for i in range(2)]


def _finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, list[str]]]:
    out = []
    try:
        for p in procs:
            err = p.communicate(timeout=timeout)[1]
            out.append((p.returncode, [line for line in err.splitlines() if line.strip()]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def _two_processes_preempted_then_resumed(tmp_path: pathlib.Path, args: list[str]):
    """A SIGTERM to process 1 alone: both processes reach JAX's preemption sync point at the
    same step, save one checkpoint there, exit 143 with one `preempted:` line each; status.json
    says "preempted"; the rerun (two processes) finishes. Returns the run directory."""
    cut = tmp_path / "cut"
    procs = _two_processes(cut, *args)
    deadline = time.monotonic() + 300
    while _lines(cut / "metrics.jsonl") < 4:
        assert all(p.poll() is None for p in procs), _finish(procs)
        assert time.monotonic() < deadline, "the run never got going"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    ended = _finish(procs)
    for code, errors in ended:
        assert code == preemption.EXIT_STATUS, errors[-20:]
        assert len(errors) <= 3 and errors[-1].startswith("preempted: "), errors
    assert ended[0][1][-1] == ended[1][1][-1]  # the same step, the same checkpoint
    status = json.loads((cut / "status.json").read_text())
    assert status["status"] == "preempted" and 0 < status["step"] < 120
    assert status["checkpoint_step"] == status["step"]
    assert max(map(int, os.listdir(cut / "checkpoints"))) == status["step"]
    before = _metrics(cut)

    for code, errors in _finish(_two_processes(cut, *args)):
        assert code == 0, errors[-20:]
    assert json.loads((cut / "status.json").read_text())["status"] == "finished"
    after = _metrics(cut)
    assert after[:len(before)] == before  # nothing written before the stop changed
    train_steps = [r["step"] for r in after if r["kind"] == "train"]
    assert train_steps == sorted(set(train_steps)) and train_steps[-1] == 119
    return cut


_TWO_ARGS = [*_TRAIN_ARGS, "--config.train.max_steps=120", "--config.train.log_every=1",
             "--config.train.record_every=1", "--config.eval.enabled=False"]


def test_two_processes_stop_at_one_step_when_one_gets_sigterm(tmp_path):
    _two_processes_preempted_then_resumed(tmp_path, _TWO_ARGS)


# Slow (a third two-process run); by default the test above checks the stop, the save at one
# step and the resume, and the single-process tests the bit-identical records.
@pytest.mark.slow
def test_two_processes_preempted_and_resumed_equal_an_uninterrupted_run(tmp_path):
    cut = _two_processes_preempted_then_resumed(tmp_path, _TWO_ARGS)
    for code, errors in _finish(_two_processes(tmp_path / "full", *_TWO_ARGS)):
        assert code == 0, errors[-20:]
    assert _metrics(cut) == _metrics(tmp_path / "full")


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
