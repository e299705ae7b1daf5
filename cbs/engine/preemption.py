"""Preemption: SIGTERM (what Slurm, Kubernetes and TPU maintenance send before they kill a job)
asks the run to save a checkpoint and stop, instead of killing it mid-step.

    from cbs.engine import preemption

    preemption.install()        # the entry points do this (cbs.engine.cli.run)
    ...                         # the loop checks preemption.requested() before each step

`install` replaces the SIGTERM handler of the process with one that only sets a flag. The
training loop (`cbs.engine.loop.Loop`) reads the flag at each step boundary: it writes the
records read so far, saves a checkpoint at the current step, writes status.json with status
"preempted" and raises `Preempted`. Sweeps, ramps and branch studies check it between runs
too. A command line then exits with status 143 (128 + SIGTERM, what a killed job reports, so
a scheduler that requeues on it still does) after one line on stderr; rerunning the same
command resumes from the checkpoint, bit-identically on CPU.

Without `install` (a library user's own process) the flag is never set and SIGTERM keeps its
usual effect. Only a single-process run handles it: with several processes the hosts would
have to agree on the step to stop at, so there the first check after SIGTERM gives the signal
its usual effect (the run ends; rerunning resumes from the last periodic checkpoint).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

__all__ = ["EXIT_STATUS", "Preempted", "check", "clear", "install", "request", "requested"]

EXIT_STATUS = 128 + signal.SIGTERM  # 143
_requested = threading.Event()


class Preempted(Exception):  # noqa: N818 (an event, not an error)
    """The run was asked to stop (SIGTERM) and saved a checkpoint; rerun it to resume."""

    def __init__(self, message: str, summary: dict[str, Any] | None = None):
        super().__init__(message)
        self.summary = summary or {}


def _handler(signum: int, frame: Any) -> None:
    del signum, frame
    _requested.set()


def install() -> bool:
    """Turns SIGTERM into a request to checkpoint and stop; True if installed (only the main
    thread can install a signal handler)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _handler)
    return True


def requested() -> bool:
    """Whether SIGTERM arrived since `install` (or `request`). In a multi-process run a
    SIGTERM is re-raised with its usual effect instead (see the module docstring)."""
    if not _requested.is_set():
        return False
    import jax

    if jax.process_count() > 1:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def request() -> None:
    """Asks the run to stop as SIGTERM would (tests, or a user's own signal handling)."""
    _requested.set()


def clear() -> None:
    """Forgets a request (tests, or a process that goes on after a preempted run)."""
    _requested.clear()


def check(where: str) -> None:
    """Raises `Preempted` if a stop was requested (between the runs of a sweep)."""
    if requested():
        raise Preempted(f"preempted (SIGTERM) {where}; rerun the same command to resume")
