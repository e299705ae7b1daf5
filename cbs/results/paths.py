"""Paths every host sees: local files, or object stores (`gs://`, `s3://`) through etils.epath.

A path is a `str` or an `os.PathLike` (`pathlib.Path`, `etils.epath.Path`). One with a URI
scheme (`gs://bucket/runs/a`) is remote and goes through `etils.epath`, the file-system layer
orbax checkpoints use (gs:// needs gcsfs, the `[gcs]` extra, or TensorFlow's gfile). Any other
path is local and goes through the os module, exactly as before.

What an object store lacks, and what cbs does instead:

- rename: an object is written whole or not at all (readers see the old object or the new
  one, never a part), so an atomic replacement is one write of the whole file
  (`cbs.results.records.write_atomic`);
- append: an append reads the object, adds the lines and writes it back whole (cost
  O(file size), atomic like a replacement; concurrent appenders to one object can lose each
  other's lines, so one process writes each file);
- locks: fcntl locks exist on local (and mounted) file systems only (`local_lock_dir`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from typing import Any

__all__ = [
    "PathLike", "epath", "exists", "is_remote", "isdir", "join", "local_lock_dir", "makedirs",
    "move", "read_bytes", "rmtree",
]

PathLike = str | os.PathLike


def is_remote(path: PathLike) -> bool:
    """True for a URI with a scheme (gs://, s3://, ...): an object store, not a local path."""
    return "://" in os.fspath(path)


def join(path: PathLike, *parts: str) -> str:
    """`path/part/...` as a string (local or URI alike: both use '/')."""
    return os.path.join(os.fspath(path), *parts)


def epath(path: PathLike) -> Any:
    """The `etils.epath.Path` of a path; for gs:// an ImportError naming the extra when no
    backend (gcsfs or TensorFlow) is installed."""
    from etils import epath as epath_lib

    text = os.fspath(path)
    if text.startswith("gs://") and not _gcs_backend_installed():
        raise ImportError(f"{text}: gs:// paths need gcsfs (or TensorFlow): "
                          'pip install -e ".[gcs]"')
    return epath_lib.Path(text)


def _gcs_backend_installed() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("gcsfs", "tensorflow"))


def exists(path: PathLike) -> bool:
    return epath(path).exists() if is_remote(path) else os.path.exists(path)


def isdir(path: PathLike) -> bool:
    return epath(path).is_dir() if is_remote(path) else os.path.isdir(path)


def makedirs(path: PathLike) -> None:
    """Creates the directory and its parents (object stores have none: a no-op there, or
    a placeholder, as the backend does)."""
    if is_remote(path):
        epath(path).mkdir(parents=True, exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


def read_bytes(path: PathLike) -> bytes | None:
    """The file's bytes, or None when it does not exist."""
    if is_remote(path):
        p = epath(path)
        return p.read_bytes() if p.exists() else None
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def move(src: PathLike, dst: PathLike) -> None:
    """Moves a file or directory tree (a copy and delete on an object store)."""
    if is_remote(src) or is_remote(dst):
        epath(src).rename(epath(dst))
    else:
        import shutil

        shutil.move(os.fspath(src), os.fspath(dst))


def rmtree(path: PathLike) -> None:
    """Removes a directory tree if it exists."""
    if is_remote(path):
        epath(path).rmtree(missing_ok=True)
    else:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def local_lock_dir(path: PathLike) -> str:
    """Where the fcntl locks of directory `path` live: `path/locks` when it is local; for a
    remote path, a directory under the local temporary directory named by a hash of `path`
    (object stores have no locks, so processes coordinate only within this machine)."""
    if not is_remote(path):
        return join(path, "locks")
    digest = hashlib.sha1(os.fspath(path).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "cbs-locks", digest)
