"""Run records: JSON lines (the record of truth), TensorBoard scalars and a progress bar.

Files in a run directory (written by process 0 only):

- `metrics.jsonl`: one JSON object per line, appended in whole lines with one `write` call
  per flush. Every record has `step` (updates applied to the parameters it describes) and
  `kind` (`"train"` or `"eval"`), plus slash-separated metric keys (`train/loss`, `opt/lr`,
  `noise/ema_b_simple`, `eval/loss`, `full_train/loss`, ...). Non-finite numbers are written
  as `NaN`/`Infinity` (Python's json). A torn last line (a kill during a write) is ignored
  by `read_records` and removed by `truncate_records`.
- `status.json`: the run's state, replaced atomically (write to a temporary file, rename).
- `tensorboard/`: tensorboardX event files (no TensorFlow needed). After a resume the
  writer is opened with `purge_step`, so TensorBoard hides events past the restored step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"


def plain_value(value: Any) -> Any:
    """Numpy/JAX scalars to Python numbers so that json can write them."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = np.asarray(value)
        return value.item() if value.ndim == 0 else value.tolist()
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return plain_value(np.asarray(value))
    return value


def write_json_atomic(path: str, obj: Mapping[str, Any]) -> None:
    """Writes `obj` as JSON to `path` through a temporary file and an atomic rename."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({k: plain_value(v) for k, v in obj.items()}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when the file does not exist."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_records(path: str) -> list[dict[str, Any]]:
    """All complete records of a JSON-lines file (a torn last line is skipped)."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def append_records(path: str, records: Iterable[Mapping[str, Any]]) -> None:
    """Appends whole records to a JSON-lines file in one write (all or none) and fsyncs."""
    data = "".join(json.dumps({k: plain_value(v) for k, v in r.items()}) + "\n" for r in records)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def truncate_records(path: str, step: int) -> int:
    """Keeps only the records with `step < step` (atomically); returns how many were dropped.

    After a restore to a state with `step` updates every later record is produced again, so
    dropping them keeps the file free of duplicates.
    """
    if not os.path.exists(path):
        return 0
    records = read_records(path)
    kept = [r for r in records if r["step"] < step]
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(records) - len(kept)
