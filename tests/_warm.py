"""Commands run as `python -m module args` in a new process that starts warm.

A command the tests run (`python -m experiments.main ...`, a guide's quick command, a
refusal) spends about 2.5 of its 3 CPU-seconds importing JAX, Flax, optax, orbax and SciPy
before it reads a flag; the suite runs dozens. Here one Python per test process (the warm
server) imports those packages once and then, for each command, forks: the child is a new
process with its own PID, working directory, environment, standard streams and exit status,
and runs the module as `python -m` does (`runpy`, `__main__`, `sys.argv`); only the
third-party packages above are already imported. No cbs module is imported before the fork,
and no optional extra (the plain-install shim blocks those in the child, before the command
starts; `test_the_warm_server_holds_no_extra_and_no_cbs_module` checks the server).

A command whose environment changes what those packages read when imported (any `JAX_*`,
`PYTHON*`, `TF_*` or thread-count variable different from the server's) runs as a real
`python -m` process instead, as does every command when CBS_TEST_COLD=1. XLA_FLAGS may
differ: XLA reads it when the command first starts a backend, after the fork.
`tests/test_warm.py` runs commands both ways and compares what they print and return.
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
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRELOAD = ("numpy", "scipy.optimize", "scipy.stats", "jax", "jax.numpy", "flax.nnx", "optax",
           "orbax.checkpoint", "ml_collections", "ml_collections.config_flags", "absl.app",
           "absl.flags", "absl.logging")
# read when the packages above are imported: a request that sets them otherwise runs cold
_IMPORT_TIME = ("JAX_", "PYTHON", "TF_", "OMP_", "OPENBLAS_", "MKL_", "LD_")

_SERVER = f"""
import importlib, json, os, runpy, sys
for name in {PRELOAD!r}:
    importlib.import_module(name)
sys.stdout.write(json.dumps({{"ready": os.getpid()}}) + "\\n")
sys.stdout.flush()
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the command's process
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
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
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
        sys.exit(0)  # exceptions and SystemExit end the process as at a script's top level
    sys.stdout.write(json.dumps({{"pid": pid}}) + "\\n")
    sys.stdout.flush()
    _, status = os.waitpid(pid, 0)
    sys.stdout.write(json.dumps({{"code": os.waitstatus_to_exitcode(status)}}) + "\\n")
    sys.stdout.flush()
"""


class _Server:
    """The warm Python of this test process, started on first use, ended at exit."""

    def __init__(self) -> None:
        self.env = base_env()
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=ROOT, env=self.env,
                                     bufsize=0)
        self.pid = self._reply(timeout=300)["ready"]
        atexit.register(self.close)

    def _reply(self, timeout: float | None) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm server ended (status {self.proc.wait()})")
        return json.loads(line)

    def run(self, args: Sequence[str], cwd: str, env: dict[str, str], block: Sequence[str],
            timeout: float) -> subprocess.CompletedProcess:
        assert self.proc.stdin is not None
        with tempfile.TemporaryDirectory(prefix="cbs-warm-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {"args": list(args), "cwd": str(cwd), "env": env, "block": list(block),
                       "stdout": out, "stderr": err}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            pid = self._reply(timeout=60)["pid"]
            try:
                code = self._reply(timeout=timeout)["code"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._reply(timeout=60)
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout) from None
            with open(out) as f_out, open(err) as f_err:
                return subprocess.CompletedProcess([sys.executable, *args], code,
                                                   f_out.read(), f_err.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


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


def python(args: Sequence[str], *, cwd: str | os.PathLike = ROOT,
           env: dict[str, str] | None = None, timeout: float = 300,
           block: Sequence[str] = (), cold: bool = False) -> subprocess.CompletedProcess:
    """`python *args` (`-m module ...` or `script.py ...`) in `cwd` with `env` (default: this
    process's, with the repository on PYTHONPATH and JAX on the CPU), its output captured as
    text; `block` names modules whose import fails, as if they were not installed. Warm when
    the environment allows, else (or with `cold`) a real process (see the module's
    docstring)."""
    env = dict(base_env() if env is None else env)
    cold = cold or os.environ.get("CBS_TEST_COLD") == "1"
    if cold or not _same_imports(env, server().env):
        if block:  # the target as `shim` expects it: a module's name or a script's path
            argv = [sys.executable, "-c", shim(block), *args[args[0] == "-m":]]
        else:
            argv = [sys.executable, *args]
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    return server().run(args, str(cwd), env, block, timeout)


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
