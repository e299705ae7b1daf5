"""Claims that let launchers share one directory: fcntl locks locally, expiring leases remotely.
A claim only divides the work (records are write-once parts): a group of trials run twice by
mistake costs time, never a record.

Locally a claim is an fcntl lock on `<dir>/<name>.lock`, released by `release` or when the
process ends. On an object store it is a lease object `<dir>/<name>.<epoch>.lease` holding the
owner (host, pid) and its expiry, created with a does-not-exist precondition (one claimant gets
it) and renewed every quarter of `lease_seconds()` until `release` deletes it; an expired
lease, or one of a dead process of this host, is taken over by creating the next epoch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import threading
import time

from cbs.results import paths, records
from cbs.results.paths import PathLike

__all__ = ["Claim", "claim", "names", "release"]

LEASE_SECONDS = 600.0  # default lease; CBS_LEASE_SECONDS overrides it
_SUFFIX = ".lease"


def lease_seconds() -> float:
    """How long a lease lasts without renewal (CBS_LEASE_SECONDS, default 600 s)."""
    return float(os.environ.get("CBS_LEASE_SECONDS", LEASE_SECONDS))


@dataclasses.dataclass
class Claim:
    """A held claim: the lock file's descriptor, or the lease's renewing thread."""

    name: str
    path: str
    fd: int | None = None
    stop: threading.Event | None = None
    thread: threading.Thread | None = None


def claim(lock_dir: PathLike, name: str, *, wait: bool = False) -> Claim | None:
    """Takes claim `name` in `lock_dir`; None when another holds it (`wait`: blocks till free)."""
    if not paths.is_remote(lock_dir):
        os.makedirs(lock_dir, exist_ok=True)
        path = os.path.join(lock_dir, f"{name}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        return Claim(name, path, fd=fd)
    poll = min(5.0, lease_seconds() / 10)
    while True:
        got = _lease(os.fspath(lock_dir), name)
        if got is not None or not wait:
            return got
        time.sleep(poll)


def release(held: Claim) -> None:
    """Gives a claim back."""
    if held.fd is not None:
        fcntl.flock(held.fd, fcntl.LOCK_UN)
        os.close(held.fd)
        return
    if held.stop is not None and held.thread is not None:
        held.stop.set()
        held.thread.join()
    paths.remove(held.path)


def names(lock_dir: PathLike) -> list[str]:
    """The names of every lock file (held or not) and lease in `lock_dir`, sorted."""
    listed = paths.listdir(lock_dir)
    return sorted({f.removesuffix(".lock") for f in listed if f.endswith(".lock")}
                  | {f.removesuffix(_SUFFIX).rsplit(".", 1)[0] for f in listed
                     if f.endswith(_SUFFIX) and _epoch(f) is not None})


def _epoch(fname: str) -> int | None:
    stem = fname.removesuffix(_SUFFIX).rsplit(".", 1)
    return int(stem[1]) if len(stem) == 2 and stem[1].isdigit() else None


def _lease(lock_dir: str, name: str) -> Claim | None:
    """One attempt at the lease of `name` (module docstring)."""
    prefix = f"{name}."
    epochs = sorted(e for f in paths.listdir(lock_dir) if f.startswith(prefix)
                    and f.endswith(_SUFFIX) and (e := _epoch(f)) is not None
                    and f == f"{prefix}{e}{_SUFFIX}")
    epoch = 0
    if epochs:
        current = _read(paths.join(lock_dir, f"{prefix}{epochs[-1]}{_SUFFIX}"))
        if current is None or _alive(current):  # None: released since the listing (later)
            return None
        epoch = epochs[-1] + 1
    path = paths.join(lock_dir, f"{prefix}{epoch}{_SUFFIX}")
    if not paths.create_new(path, _body()):
        return None  # another launcher created it first
    if epochs:
        paths.remove(paths.join(lock_dir, f"{prefix}{epochs[-1]}{_SUFFIX}"))  # the dead one
    stop = threading.Event()
    thread = threading.Thread(target=_renew, args=(path, stop), daemon=True,
                              name=f"lease {name}")
    thread.start()
    return Claim(name, path, stop=stop, thread=thread)


def _body() -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                       "expires": time.time() + lease_seconds()}).encode()


def _read(path: str) -> dict | None:
    raw = paths.read_many([path]).get(path)
    if raw is None:
        return None
    try:
        lease = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {"expires": 0.0}  # damaged: counts as expired
    return lease if isinstance(lease, dict) else {"expires": 0.0}


def _alive(lease: dict) -> bool:
    """True while a lease holds: not expired, and not owned by a dead process of this host."""
    if float(lease.get("expires", 0.0)) <= time.time():
        return False
    if lease.get("host") == socket.gethostname() and isinstance(lease.get("pid"), int):
        try:
            os.kill(lease["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return True


def _renew(path: str, stop: threading.Event) -> None:
    while not stop.wait(lease_seconds() / 4):
        with contextlib.suppress(OSError):  # a missed renewal: the next one may succeed
            records.write_atomic(path, _body())
