"""Preemption and Ctrl-C: SIGTERM (what Slurm, Kubernetes and TPU maintenance send before they
kill a job) and SIGINT ask the run to save a checkpoint and stop, instead of dying mid-step.

`install` (which `cbs.runtime.cli.run` calls) replaces both handlers with ones that set a flag,
which the training loop (`cbs.engine.loop.Loop`) reads at each step boundary (sweeps and
studies between runs too): it saves, records the status and raises `Preempted`. A second
Ctrl-C stops at once; outside training (`active`) SIGINT stays a `KeyboardInterrupt`.

On several processes the check is JAX's preemption sync point (`jax.distributed.initialize`
installs its SIGTERM handler, so install before it): all processes get True at the same
`requested()` call, so they save at the same step if they make the same calls in the same
order. A Ctrl-C is passed on as a SIGTERM to this process. docs/scaling.md ("Resuming after
preemption") gives the exit statuses and the resume.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = [
    "EXIT_STATUS", "INTERRUPT_EXIT_STATUS", "Preempted", "active", "check", "clear", "install",
    "reason", "request", "requested", "status",
]

EXIT_STATUS = 128 + signal.SIGTERM  # 143
INTERRUPT_EXIT_STATUS = 128 + signal.SIGINT  # 130
_requested = threading.Event()
_state: dict[str, Any] = {"signal": None, "active": 0, "calls": 0, "synced": False}


class Preempted(Exception):  # noqa: N818 (an event, not an error)
    """The run was asked to stop and saved a checkpoint. `status`: "preempted" or "interrupted";
    `exit_status`: 143 or 130."""

    def __init__(self, message: str, summary: dict[str, Any] | None = None):
        super().__init__(message)
        self.summary = summary or {}
        self.status = status()
        self.exit_status = INTERRUPT_EXIT_STATUS if self.status == "interrupted" else EXIT_STATUS


def _distributed() -> bool:
    """Whether this process is one of a `jax.distributed` runtime (touching no device)."""
    jax = sys.modules.get("jax")
    return bool(jax is not None and jax.distributed.is_initialized())


def _on_sigterm(signum: int, frame: Any) -> None:
    del signum, frame
    _state["signal"] = _state["signal"] or "SIGTERM"
    _requested.set()


def _on_sigint(signum: int, frame: Any) -> None:
    del signum, frame
    if not _state["active"]:
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C stops at once
    _state["signal"] = _state["signal"] or "SIGINT"
    _requested.set()
    print("interrupt: stopping after this step to save a checkpoint (Ctrl-C again stops at "
          "once)", file=sys.stderr, flush=True)
    if _distributed():  # tell the other processes through the coordination service
        os.kill(os.getpid(), signal.SIGTERM)


def install() -> bool:
    """Turns SIGTERM and SIGINT into a stop request; True if installed (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if not _distributed():
        signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigint)
    return True


@contextlib.contextmanager
def active() -> Iterator[None]:
    """Marks training in progress: within it the first SIGINT is a stop request."""
    _state["active"] += 1
    try:
        yield
    finally:
        _state["active"] -= 1


def requested() -> bool:
    """Whether to stop now: a signal arrived (one process), or every process reached the
    preemption sync point (several; module docstring)."""
    if _distributed() and not _state["synced"]:
        from jax.experimental import multihost_utils

        _state["synced"] = bool(multihost_utils.reached_preemption_sync_point(_state["calls"]))
        _state["calls"] += 1
        if _state["synced"] and _state["signal"] is None:
            _state["signal"] = "SIGTERM"
        return _state["synced"]
    return _state["synced"] or _requested.is_set()


def status() -> str:
    """The status a stopped run records: "interrupted" after SIGINT, else "preempted"."""
    return "interrupted" if _state["signal"] == "SIGINT" else "preempted"


def reason() -> str:
    """"preempted (SIGTERM)" or "interrupted (SIGINT)", for messages."""
    return f"{status()} ({_state['signal'] or 'SIGTERM'})"


def request(signal_name: str = "SIGTERM") -> None:
    """Asks the run to stop as SIGTERM (or SIGINT) would."""
    _state["signal"] = signal_name
    _requested.set()


def clear() -> None:
    """Forgets a request (tests, or a process that goes on after a stopped run)."""
    _requested.clear()
    _state.update(signal=None, synced=False)


def check(where: str) -> None:
    """Raises `Preempted` if a stop was requested (between the runs of a sweep)."""
    if requested():
        raise Preempted(f"{reason()} {where}; rerun the same command to resume")
