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
import math
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"
TENSORBOARD_DIR = "tensorboard"


def _plain(value: Any) -> Any:
    """Numpy/JAX scalars to Python numbers so that json can write them."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = np.asarray(value)
        return value.item() if value.ndim == 0 else value.tolist()
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return _plain(np.asarray(value))
    return value


def write_json_atomic(path: str, obj: Mapping[str, Any]) -> None:
    """Writes `obj` as JSON to `path` through a temporary file and an atomic rename."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({k: _plain(v) for k, v in obj.items()}, f, indent=1, sort_keys=True)
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
    data = "".join(json.dumps({k: _plain(v) for k, v in r.items()}) + "\n" for r in records)
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


class MetricsWriter:
    """Appends records to `metrics.jsonl` and TensorBoard; shows a progress bar.

    Args:
      workdir: the run directory.
      start_step: the restored step (records at or after it are dropped first).
      total_steps: length of the progress bar (None for unknown).
      enabled: False on processes other than 0: every method is then a no-op.
      progress: show a tqdm bar (loss and throughput).
      tensorboard: write TensorBoard events.
    """

    def __init__(self, workdir: str, *, start_step: int = 0, total_steps: int | None = None,
                 enabled: bool = True, progress: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, METRICS_FILE)
        self._tb = self._bar = None
        self._last_time, self._last_examples = time.perf_counter(), None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        truncate_records(self.path, start_step)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR),
                                     purge_step=start_step if start_step > 0 else None)
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step",
                             dynamic_ncols=True, mininterval=1.0)

    def write(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Appends whole records in one write; mirrors numeric values to TensorBoard."""
        if not self.enabled:
            return
        records = [{k: _plain(v) for k, v in r.items()} for r in records]
        if not records:
            return
        os.write(self._fd, "".join(json.dumps(r) + "\n" for r in records).encode())
        if self._tb is not None:
            for r in records:
                for k, v in r.items():
                    if "/" in k and isinstance(v, (int, float)) and not isinstance(v, bool):
                        self._tb.add_scalar(k, v, r["step"])
        self._update_bar(records)

    def _update_bar(self, records: list[dict[str, Any]]) -> None:
        if self._bar is None:
            return
        train = [r for r in records if r.get("kind") == "train"]
        if not train:
            return
        last = train[-1]
        now = time.perf_counter()
        examples = last.get("data/examples_seen", 0) + last.get("data/batch_size", 0)
        postfix = {"loss": f"{last.get('train/loss', math.nan):.4g}"}
        if self._last_examples is not None and now > self._last_time:
            postfix["ex/s"] = f"{(examples - self._last_examples) / (now - self._last_time):.4g}"
        self._last_time, self._last_examples = now, examples
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(last["step"] + 1 - self._bar.n)

    def sync(self) -> None:
        """Makes everything written so far durable (called before each checkpoint)."""
        if not self.enabled:
            return
        os.fsync(self._fd)
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flushes and closes the files and the bar."""
        if not self.enabled:
            return
        self.sync()
        os.close(self._fd)
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        self.enabled = False
