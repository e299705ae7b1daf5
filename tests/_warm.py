"""Commands run as `python -m module args` in a new process that starts warm.

A command the tests run (a training run, a guide's quick command, a refusal) spends about 2.5
of its 3 CPU-seconds importing JAX, Flax, optax, orbax and SciPy before it reads a flag; the
suite runs dozens. Here one Python per test process (the warm server) imports those packages
once and then, for each command, forks: the child is a new process with its own PID, working
directory, environment, standard streams and exit status, and runs the module as `python -m`
does (`runpy`, `__main__`, `sys.argv`; a script and `-c` code likewise); only the third-party
packages above are already imported. No cbs module is imported before the fork, and no
optional extra (the plain-install shim blocks those in the child, before the command starts).
`python` waits for the command; `popen` returns at once with an object used as a
`subprocess.Popen` (commands that run side by side, signals).

A command whose environment changes what those packages read when imported (any `JAX_*`,
`PYTHON*`, `TF_*` or thread-count variable different from the server's) runs as a real
`python` process instead, as does every command when CBS_TEST_COLD=1. XLA_FLAGS may
differ: XLA reads it when the command first starts a backend, after the fork.
`tests/test_warm.py` checks all of this and runs commands both ways to compare what they
print and return.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRELOAD = ("numpy", "scipy.optimize", "scipy.stats", "jax", "jax.numpy", "flax.nnx", "optax",
           "orbax.checkpoint", "ml_collections", "ml_collections.config_flags", "absl.app",
           "absl.flags", "absl.logging")
# read when the packages above are imported: a request that sets them otherwise runs cold
_IMPORT_TIME = ("JAX_", "PYTHON", "TF_", "OMP_", "OPENBLAS_", "MKL_", "LD_")

_SERVER = f"""
import importlib, json, os, runpy, select, sys
for name in {PRELOAD!r}:
    importlib.import_module(name)


def send(message):
    os.write(1, (json.dumps(message) + "\\n").encode())


def command(req):  # in the forked process: becomes the command, never returns
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        if path is None:  # standard error into standard output
            os.dup2(1, 2)
        else:
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(os.devnull)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if "tempfile" in sys.modules:  # TMPDIR as the command's environment gives it
        sys.modules["tempfile"].tempdir = None
    for name in req["block"]:
        sys.modules[name] = None
    importlib.invalidate_caches()
    args = req["args"]
    if args[0] == "-m":
        sys.argv = args[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        exec(compile(args[1], "<string>", "exec"), {{"__name__": "__main__"}})
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")
    sys.exit(0)  # exceptions and SystemExit end the process as at a script's top level


send({{"ready": os.getpid()}})
pending, running = b"", 0
while True:
    while running:  # report each command that ended
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        running -= 1
        send({{"ended": pid, "code": os.waitstatus_to_exitcode(status)}})
    if not select.select([0], [], [], 0.02 if running else None)[0]:
        continue
    chunk = os.read(0, 1 << 16)
    if not chunk:
        break  # the test process is gone
    pending += chunk
    while b"\\n" in pending:
        line, pending = pending.split(b"\\n", 1)
        pid = os.fork()
        if pid == 0:
            command(json.loads(line))
        running += 1
        send({{"started": pid}})
"""


class _Server:
    """The warm Python of this test process, started on first use, ended at exit; it starts
    commands and reports when each ends."""

    def __init__(self) -> None:
        self.env = base_env()
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=ROOT, env=self.env,
                                     bufsize=0)
        self.pending = b""
        self.ended: dict[int, int] = {}  # pid -> exit status
        self.pid = self._message(timeout=300)["ready"]
        atexit.register(self.close)

    def _message(self, timeout: float | None) -> dict:
        """The server's next message, or TimeoutError."""
        assert self.proc.stdout is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError(f"the warm server ended (status {self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        message = json.loads(line)
        if "ended" in message:
            self.ended[message["ended"]] = message["code"]
        return message

    def start(self, args: Sequence[str], cwd: str, env: dict[str, str], block: Sequence[str],
              stdout: str, stderr: str | None) -> int:
        assert self.proc.stdin is not None
        request = {"args": list(args), "cwd": cwd, "env": env, "block": list(block),
                   "stdout": stdout, "stderr": stderr}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        while "started" not in (message := self._message(timeout=60)):
            pass
        # a PID is reused once its process is reaped: an earlier command's status is not this one's
        self.ended.pop(message["started"], None)
        return message["started"]

    def status(self, pid: int, timeout: float | None) -> int | None:
        """The exit status of command `pid`, waiting up to `timeout` seconds (0: a look)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.ended:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._message(timeout=left)
            except TimeoutError:
                return None
        return self.ended[pid]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Process:
    """A command started warm, used as a `subprocess.Popen` with text output: `pid`, `poll`,
    `wait`, `communicate`, `send_signal`, `terminate`, `kill`, `returncode`."""

    def __init__(self, server: _Server, args: Sequence[str], cwd: str, env: dict[str, str],
                 block: Sequence[str], stderr_to_stdout: bool = False) -> None:
        self.args = [sys.executable, *args]
        self._server = server
        self._tmp = tempfile.TemporaryDirectory(prefix="cbs-warm-")
        self._out = os.path.join(self._tmp.name, "stdout")
        self._err = None if stderr_to_stdout else os.path.join(self._tmp.name, "stderr")
        self.pid = server.start(args, cwd, env, block, self._out, self._err)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.status(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.status(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self.wait(timeout)
        with open(self._out) as out:
            text = out.read()
        if self._err is None:
            return text, None
        with open(self._err) as err:
            return text, err.read()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_server: _Server | None = None


def base_env() -> dict[str, str]:
    """This process's environment with the repository on PYTHONPATH and JAX on the CPU."""
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")


def _same_imports(env: dict[str, str], server_env: dict[str, str]) -> bool:
    def read(e):
        return {k: v for k, v in e.items() if k.startswith(_IMPORT_TIME)}
    return read(env) == read(server_env)


def server() -> _Server:
    global _server
    if _server is None or _server.proc.poll() is not None:  # first use, or it ended
        _server = _Server()
    return _server


def popen(args: Sequence[str], *, cwd: str | os.PathLike = ROOT,
          env: dict[str, str] | None = None, block: Sequence[str] = (),
          stderr_to_stdout: bool = False, cold: bool = False) -> Process | subprocess.Popen:
    """`python *args` (`-m module ...`, `-c code ...` or `script.py ...`) started in `cwd`
    with `env` (default: `base_env()`), not waited for: a `Process`, or where the command runs
    cold (see the module's docstring, or `cold`) a `subprocess.Popen`; both with text output.
    `block` (with `-m` or a script) names modules whose import fails, as if they were not
    installed; standard error goes into standard output with `stderr_to_stdout`."""
    env = dict(base_env() if env is None else env)
    if cold or os.environ.get("CBS_TEST_COLD") == "1" or not _same_imports(env, server().env):
        if block:  # the target as `shim` expects it: a module's name or a script's path
            argv = [sys.executable, "-c", shim(block), *args[args[0] == "-m":]]
        else:
            argv = [sys.executable, *args]
        return subprocess.Popen(argv, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if stderr_to_stdout
                                else subprocess.PIPE)
    return Process(server(), args, str(cwd), env, block, stderr_to_stdout)


def python(args: Sequence[str], *, cwd: str | os.PathLike = ROOT,
           env: dict[str, str] | None = None, timeout: float = 300,
           block: Sequence[str] = (), cold: bool = False) -> subprocess.CompletedProcess:
    """`popen` waited for, as `subprocess.run` with its output captured: killed after
    `timeout` seconds (`subprocess.TimeoutExpired`)."""
    proc = popen(args, cwd=cwd, env=env, block=block, cold=cold)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(60)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def shim(block: Sequence[str]) -> str:
    """`python -c` code that runs `argv[1]` (a module's name, or a script's path ending in
    .py) with `argv[2:]` after making the import of each name in `block` fail."""
    return f"""
import runpy, sys
for name in {tuple(block)!r}:
    sys.modules[name] = None
target = sys.argv[1]
sys.argv = sys.argv[1:]
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""
