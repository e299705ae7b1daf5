"""The warm way of running commands (tests/_warm.py) is a new process that runs the command as
`python -m` does: the same output, exit status and files as a real process, its own PID,
environment and devices, no cbs module or optional extra imported before it starts."""

from __future__ import annotations

import json
import os
import subprocess

import _plain_install
import _warm
import pytest
from conftest import SUBPROCESS_XLA_FLAGS

ROOT = _warm.ROOT
PROBE = f"""
import json, os, sys
EXTRAS = {_plain_install.EXTRAS!r}
print(json.dumps({{
    "pid": os.getpid(), "cwd": os.getcwd(), "argv": sys.argv,
    "env": os.environ.get("CBS_WARM_PROBE"),
    "preloaded": "jax" in sys.modules,
    "early": sorted(m for m in sys.modules if m.split(".")[0] in ("cbs", "experiments")),
    "extras": {{name: name in sys.modules and sys.modules[name] is not None
               for name in EXTRAS}}}}))
importable = []
for name in EXTRAS:
    try:
        __import__(name)
        importable.append(name)
    except ImportError:
        pass
print(json.dumps(importable))
import jax
print(jax.device_count())
raise SystemExit(int(sys.argv[1]))
"""


@pytest.mark.skipif(os.environ.get("CBS_TEST_COLD") == "1",
                    reason="CBS_TEST_COLD=1 runs every command as a plain process: there is "
                           "no warm command to check")
def test_a_warm_command_is_a_new_process_with_its_own_environment_and_devices(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = _warm.base_env() | {"CBS_WARM_PROBE": "yes", "XLA_FLAGS":
                              f"--xla_force_host_platform_device_count=3 {SUBPROCESS_XLA_FLAGS}"}
    proc = _warm.python([str(script), "7", "x"], cwd=tmp_path, env=env,
                        block=_plain_install.EXTRAS)
    assert proc.returncode == 7, proc.stderr
    first, importable, devices = proc.stdout.splitlines()
    seen = json.loads(first)
    assert seen["preloaded"], "the command ran cold: the warm server was not used"
    assert seen["pid"] not in (os.getpid(), _warm.server().pid)
    assert seen["cwd"] == str(tmp_path) and seen["argv"] == [str(script), "7", "x"]
    assert seen["env"] == "yes" and devices == "3"  # XLA_FLAGS read after the fork
    assert seen["early"] == [], "no cbs module is imported before the command starts"
    assert not any(seen["extras"].values()), seen["extras"]
    assert json.loads(importable) == [], "every extra is blocked, as on a plain install"
    again = json.loads(_warm.python([str(script), "0"], cwd=tmp_path).stdout.splitlines()[0])
    assert again["pid"] != seen["pid"] and again["env"] is None  # nothing carried over


def test_an_environment_read_at_import_runs_cold(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = _warm.base_env() | {"JAX_ENABLE_X64": "1"}
    proc = _warm.python([str(script), "0"], cwd=tmp_path, env=env)
    assert proc.returncode == 0 and not json.loads(proc.stdout.splitlines()[0])["preloaded"]


@pytest.mark.parametrize("args", [
    ("-m", "experiments.main", "--config=experiments/configs/digits_mlp.py:tinny",
     "--workdir={tmp}/w"),  # a refusal: one line, status 2
    ("-m", "experiments.analyze", "--sweep_dir={tmp}/none"),
], ids=["config_word", "no_sweep"])
def test_warm_and_cold_print_and_return_the_same(args, tmp_path):
    runs = []
    for cold in (False, True):
        tmp = tmp_path / ("cold" if cold else "warm")
        tmp.mkdir()
        proc = _warm.python([a.format(tmp=tmp) for a in args], cold=cold,
                            block=_plain_install.EXTRAS)
        runs.append((proc.returncode, proc.stdout.replace(str(tmp), "TMP"),
                     proc.stderr.replace(str(tmp), "TMP"), sorted(os.listdir(tmp))))
    assert runs[0] == runs[1]
    assert runs[0][0] == 2 and len(runs[0][2].strip().splitlines()) == 1, runs[0]


def test_an_uncaught_exception_ends_the_command_as_at_top_level(tmp_path):
    (tmp_path / "fails.py").write_text("print('before')\nraise ValueError('no')\n")
    warm, cold = (_warm.python([str(tmp_path / "fails.py")], cold=c) for c in (False, True))
    assert warm.returncode == cold.returncode == 1 and warm.stdout == cold.stdout == "before\n"
    assert warm.stderr.splitlines()[-1] == cold.stderr.splitlines()[-1] == "ValueError: no"


def test_a_warm_command_that_runs_past_its_timeout_is_killed(tmp_path):
    (tmp_path / "sleeps.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "ok.py").write_text("print('ok')\n")
    with pytest.raises(subprocess.TimeoutExpired):
        _warm.python([str(tmp_path / "sleeps.py")], timeout=1)
    assert _warm.python([str(tmp_path / "ok.py")]).stdout == "ok\n"  # the server goes on


def test_code_given_with_c_runs_as_python_c_does():
    code = "import sys; print(sys.argv, __name__)"
    warm, cold = (_warm.python(["-c", code, "a", "b"], cold=c) for c in (False, True))
    assert warm.stdout == cold.stdout == "['-c', 'a', 'b'] __main__\n" and warm.returncode == 0


class _Pipes:
    """The warm server's side of its pipes, written by the test: `stdout` carries the
    messages the test wrote, `stdin` takes the requests."""

    def __init__(self) -> None:
        read, self.write = os.pipe()
        self.stdout = os.fdopen(read, "rb", buffering=0)
        self.stdin = open(os.devnull, "wb", buffering=0)

    def send(self, **message) -> None:
        os.write(self.write, (json.dumps(message) + "\n").encode())

    def poll(self) -> None:
        return None


def test_a_reused_pid_does_not_return_an_earlier_commands_status():
    """The system gives a new process the PID of one already reaped: the status the first
    command ended with is not the second one's, which is still running."""
    pipes = _Pipes()
    server = object.__new__(_warm._Server)
    server.proc, server.pending, server.ended = pipes, b"", {}
    pipes.send(started=4242)
    first = server.start(["-c", "pass"], "/", {}, (), os.devnull, None)
    pipes.send(ended=4242, code=3)
    assert server.status(first, timeout=5) == 3
    pipes.send(started=4242)  # the same PID again, for another command
    second = server.start(["-c", "pass"], "/", {}, (), os.devnull, None)
    assert second == first and server.status(second, timeout=0) is None  # not ended yet
    pipes.send(ended=4242, code=0)
    assert server.status(second, timeout=5) == 0
    pipes.stdout.close()
    pipes.stdin.close()
    os.close(pipes.write)
