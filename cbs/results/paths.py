"""Paths every host sees: local files, or object stores (`gs://`, `s3://`) through etils.epath.

A path with a URI scheme (`gs://bucket/runs/a`) is remote and goes through `etils.epath`, the
file-system layer orbax uses (gs:// needs gcsfs, the `[gcs]` extra, or TensorFlow); any other
through the os module. An object store has no rename (`cbs.results.records.write_atomic`
writes whole objects), no append (`cbs.results.shared`: write-once parts) and no fcntl lock
(`create_new`, on which `cbs.results.leases` builds leases). Remote listings and reads bypass
fsspec's listing cache: other processes add objects to the directories cbs lists.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import shutil
import uuid
from collections.abc import Sequence
from typing import Any

from cbs.results.extras import install_command

__all__ = [
    "PathLike", "create_new", "epath", "exists", "first_missing", "is_remote", "isdir", "join",
    "listdir", "listdir_versions", "makedirs", "move", "read_bytes", "read_many", "read_text",
    "remove", "remove_if_empty", "rmdir", "rmtree",
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
                          f"{install_command('gcs')}")
    return epath_lib.Path(text)


def _gcs_backend_installed() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("gcsfs", "tensorflow"))


def exists(path: PathLike) -> bool:
    return epath(path).exists() if is_remote(path) else os.path.exists(path)


def isdir(path: PathLike) -> bool:
    return epath(path).is_dir() if is_remote(path) else os.path.isdir(path)


def makedirs(path: PathLike) -> None:
    """Creates the directory and its parents (on an object store, as the backend does)."""
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


def read_text(path: PathLike) -> str:
    """The file's text (UTF-8); FileNotFoundError when it does not exist."""
    raw = read_bytes(path)
    if raw is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(path))
    return raw.decode("utf-8")


def move(src: PathLike, dst: PathLike) -> None:
    """Moves a file or directory tree (a copy and delete on an object store)."""
    if is_remote(src) or is_remote(dst):
        epath(src).rename(epath(dst))
    else:
        shutil.move(os.fspath(src), os.fspath(dst))


def rmtree(path: PathLike) -> None:
    """Removes a directory tree if it exists."""
    if is_remote(path):
        epath(path).rmtree(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def first_missing(path: PathLike) -> str | None:
    """The outermost directory on `path` that writing to it would create (None: `path`
    exists; on an object store, `path` when nothing is there)."""
    if is_remote(path):
        try:
            return None if exists(path) else os.fspath(path)
        except ImportError:  # no backend for the store: the command says which extra, itself
            return os.fspath(path)
    text = os.path.abspath(path)
    if os.path.exists(text):
        return None
    while not os.path.exists(os.path.dirname(text)):
        text = os.path.dirname(text)
    return text


def remove_if_empty(root: PathLike) -> None:
    """Removes `root` and the directories under it if none holds a file (local only)."""
    if is_remote(root) or not os.path.isdir(root):
        return
    root = os.fspath(root)
    if any(filenames for _, _, filenames in os.walk(root)):
        return
    for dirpath, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            return


def rmdir(path: PathLike) -> None:
    """Removes the directory if it is empty (local only)."""
    if not is_remote(path):
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _fresh_fs(path: PathLike) -> tuple[Any, str]:
    """(fsspec file system, bare path), its listing cache dropped (module docstring)."""
    import fsspec

    epath(path)  # the one-line error naming the extra when gs:// has no backend
    fs, bare = fsspec.core.url_to_fs(os.fspath(path))
    fs.invalidate_cache()
    return fs, bare


def listdir(path: PathLike) -> list[str]:
    """The names in directory `path`, sorted; [] when it does not exist."""
    if not is_remote(path):
        return sorted(os.listdir(path)) if os.path.isdir(path) else []
    return list(listdir_versions(path))


def listdir_versions(path: PathLike) -> dict[str, str | None]:
    """{name: version} of the entries of directory `path`, sorted ({} when it does not exist):
    on an object store the object's generation, locally None."""
    if not is_remote(path):
        return dict.fromkeys(listdir(path))
    fs, bare = _fresh_fs(path)
    try:
        found = fs.ls(bare, detail=True)
    except FileNotFoundError:
        return {}
    here = os.path.basename(bare.rstrip("/"))
    named = {os.path.basename(entry["name"].rstrip("/")): entry for entry in found}
    return {name: str(next((e[k] for k in ("generation", "etag", "md5Hash") if e.get(k)),
                           (e.get("size"), e.get("created"))))
            for name, e in sorted(named.items()) if name and name != here}


def read_many(paths: Sequence[PathLike]) -> dict[str, bytes]:
    """{path: bytes} of the files that exist among `paths` (remote ones fetched together)."""
    out = {os.fspath(p): raw for p in paths
           if not is_remote(p) and (raw := read_bytes(p)) is not None}
    remote = [os.fspath(p) for p in paths if is_remote(p)]
    if remote:
        fs, _ = _fresh_fs(remote[0])
        got = fs.cat(remote, on_error="omit")  # fetched concurrently
        plain = lambda p: p.split("://", 1)[-1].strip("/")  # keys may lack the scheme
        by_key = {plain(k): v for k, v in got.items()}
        out |= {p: by_key[plain(p)] for p in remote if plain(p) in by_key}
    return out


def create_new(path: PathLike, data: bytes) -> bool:
    """Writes `data` to `path` only if nothing is there yet, atomically (a hard link, or a
    does-not-exist precondition on an object store); True if it wrote."""
    if is_remote(path):
        fs, bare = _fresh_fs(path)
        try:
            fs.pipe_file(bare, data, mode="create")
        except FileExistsError:
            return False
        return True
    text = os.fspath(path)
    tmp = f"{text}.tmp.{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, text)
    except FileExistsError:
        return False
    finally:
        os.remove(tmp)
    return True


def remove(path: PathLike) -> None:
    """Removes a file if it exists."""
    if is_remote(path):
        fs, bare = _fresh_fs(path)
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(bare)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
