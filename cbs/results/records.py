"""Run records: JSON lines (the record of truth) and atomically replaced JSON files.

`metrics.jsonl` holds one JSON object per line, appended in whole lines: `step` (updates
applied to the parameters it describes), `kind` ("train" or "eval") and slash-separated metric
keys (`train/loss`, `opt/lr`, `eval/loss`, ...), non-finite numbers as `NaN`/`Infinity`. A torn
last line (no final newline) is not a record, and `append_records` cuts it off first; a
complete line that is not a JSON object holding the required keys is skipped with a
`CorruptRecordWarning`, and what it recorded counts as not done. Locally a replacement is a
temporary file, fsync and rename, and an append one `write` on an O_APPEND descriptor; on an
object store (`gs://...`) both are one write of the object.
"""

from __future__ import annotations

import errno
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from cbs.results import paths
from cbs.results.paths import PathLike

__all__ = [
    "CorruptRecordWarning", "append_records", "lines_in", "plain_value", "read_json",
    "exception_chain", "read_records", "truncate_records", "write_atomic", "write_error",
    "write_json_atomic",
]


class CorruptRecordWarning(UserWarning):
    """A line of a JSON-lines file could not be read and was skipped."""


def plain_value(value: Any) -> Any:
    """Numpy/JAX scalars to Python numbers so that json can write them."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = np.asarray(value)
        return value.item() if value.ndim == 0 else value.tolist()
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return plain_value(np.asarray(value))
    return value


def write_atomic(path: PathLike, data: str | bytes) -> None:
    """Replaces the file at `path` by `data` atomically: readers see the old or the new."""
    raw = data.encode() if isinstance(data, str) else data
    if paths.is_remote(path):
        paths.epath(path).write_bytes(raw)
        return
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}.{os.urandom(4).hex()}"  # unique across hosts too
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:  # disk full, quota, I/O error: the old file stays as it was
        if os.path.exists(tmp):
            os.remove(tmp)
        raise write_error(err, path) from None


def write_json_atomic(path: PathLike, obj: Mapping[str, Any]) -> None:
    """Writes `obj` as JSON to `path` atomically (`write_atomic`)."""
    write_atomic(path, json.dumps({k: plain_value(v) for k, v in obj.items()}, indent=1,
                                  sort_keys=True))


def read_json(path: PathLike) -> dict[str, Any] | None:
    """The JSON object in `path` (None: no file); ValueError naming a damaged file."""
    raw = paths.read_bytes(path)
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); restore or delete it") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a JSON {type(obj).__name__}, not an object; "
                         "restore or delete it")
    return obj


def _parse(line: bytes, required: Sequence[str]) -> tuple[dict[str, Any] | None, str]:
    """(record, "") or (None, why it is not one)."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return None, f"not JSON: {err}"
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an object"
    missing = [k for k in required if k not in record]
    if missing:
        return None, f"missing {', '.join(missing)}"
    return record, ""


def read_records(path: PathLike, *, required: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The readable records holding every key in `required`, in file order ([] if missing)."""
    raw = paths.read_bytes(path)
    return [] if raw is None else _records_in(raw, path, required)


def _records_in(raw: bytes, path: PathLike, required: Sequence[str]) -> list[dict[str, Any]]:
    return [r for _, r in lines_in(raw, path, required)]  # a frame, for the warnings' stacklevel


def lines_in(raw: bytes, path: PathLike, required: Sequence[str]
              ) -> list[tuple[bytes, dict[str, Any]]]:
    """(line as stored, record) of each record in the bytes `raw` of `path`."""
    lines = raw.split(b"\n")
    out = []
    for number, line in enumerate(lines[:-1], start=1):  # lines[-1]: torn or empty
        if not line.strip():
            continue
        record, why = _parse(line, required)
        if record is None:
            warnings.warn(f"{path}:{number}: skipped a corrupt record ({why}); what it "
                          "recorded counts as not done", CorruptRecordWarning, stacklevel=4)
            continue
        out.append((line, record))
    return out


def repair_tail(path: PathLike) -> None:
    """Cuts a torn last line (bytes after the final newline) off local file `path`."""
    size = pos = 0  # the size, and the offset just past the last newline
    if os.path.exists(path):
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = pos = f.tell()
            while pos > 0:  # scan backwards for the last newline, 4096 bytes at a time
                start = max(0, pos - 4096)
                f.seek(start)
                cut = f.read(pos - start).rfind(b"\n")
                if cut >= 0:
                    pos = start + cut + 1
                    break
                pos = start
    if pos < size:
        os.truncate(path, pos)
        _warn_torn(path, size - pos)


def _warn_torn(path: PathLike, size: int) -> None:
    warnings.warn(f"{path}: removed a torn last line ({size} bytes, an interrupted write)",
                  CorruptRecordWarning, stacklevel=3)


def _whole_lines(path: PathLike, raw: bytes) -> bytes:
    """`raw` up to its last newline (a warning when a torn line is cut)."""
    kept = raw[:raw.rfind(b"\n") + 1]
    if len(kept) < len(raw):
        _warn_torn(path, len(raw) - len(kept))
    return kept


def append_records(path: PathLike, records: Iterable[Mapping[str, Any]]) -> None:
    """Appends whole records in one write (all or none) and fsyncs, cutting a torn line first."""
    data = "".join(json.dumps({k: plain_value(v) for k, v in r.items()}) + "\n" for r in records)
    if not data:
        return
    if paths.is_remote(path):
        kept = _whole_lines(path, paths.read_bytes(path) or b"")
        write_atomic(path, kept + data.encode())
        return
    repair_tail(path)
    raw = data.encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise write_error(err, path) from None
    size = os.fstat(fd).st_size
    try:
        written = os.write(fd, raw)
        if written != len(raw):  # a short write: the device filled up part-way
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        os.fsync(fd)
    except OSError as err:  # cut back to the records that were whole: nothing torn
        os.ftruncate(fd, size)
        raise write_error(err, path) from None
    finally:
        os.close(fd)


def write_error(err: OSError, path: PathLike) -> OSError:
    """`err` (disk full, quota, read-only, I/O) as an OSError of its errno naming the file
    written, for a one-line message (`cbs.runtime.cli.message`)."""
    code = err.errno or errno.EIO
    return type(err)(code, err.strerror or os.strerror(code), os.fspath(path))


def exception_chain(err: BaseException | None) -> Iterator[BaseException]:
    """`err`, then its causes and contexts (each once): where the OS error behind a failure is."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def truncate_records(path: PathLike, step: int) -> int:
    """Keeps only the readable records with `step < step` (atomically: a resumed run writes
    the later ones again); returns how many were dropped, torn and corrupt lines uncounted."""
    raw = paths.read_bytes(path)
    if raw is None:
        return 0
    lines = len(raw.splitlines())
    records = read_records(path, required=("step",))
    kept = [r for r in records if r["step"] < step]
    if len(kept) == lines:
        return 0
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(records) - len(kept)
