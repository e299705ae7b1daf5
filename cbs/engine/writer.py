"""The run's record writer: JSON lines (the record of truth), TensorBoard scalars, a progress bar;
and `CountBar`, the progress bar of a study's finished trials (sweeps, ramps, branches).

The JSON-lines format and its readers are `cbs.results.records`; this module adds the live
side of a run (process 0 only): appending records as they are read from the device, mirroring
them to TensorBoard (tensorboardX, no TensorFlow needed) and a tqdm bar.

The run directory may be remote (`gs://...`, `cbs.results.paths`). Locally each `write` is
one append to `metrics.jsonl`; an object store has no append, so there records are held in
memory and `sync` (before each checkpoint, and at `close`) adds them to the object in one
atomic write: a reader sees them at checkpoints, and a resume drops records past its
checkpoint anyway.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cbs import install_command
from cbs.results import paths
from cbs.results.files import METRICS_FILE
from cbs.results.paths import PathLike
from cbs.results.records import append_records, plain_value, truncate_records

__all__ = ["TENSORBOARD_DIR", "CountBar", "MetricsWriter", "summary_writer_class"]

TENSORBOARD_DIR = "tensorboard"


def summary_writer_class() -> type:
    """tensorboardX's SummaryWriter; an ImportError naming the extra when it is missing."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError as err:
        raise ImportError("config.train.tensorboard=True needs tensorboardX: "
                          f"{install_command('tensorboard')} (or set it to False)") from err
    return SummaryWriter


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

    def __init__(self, workdir: PathLike, *, start_step: int = 0,
                 total_steps: int | None = None, enabled: bool = True, progress: bool = True,
                 tensorboard: bool = False):
        self.enabled = enabled
        self.path = paths.join(workdir, METRICS_FILE)
        self._tb = self._bar = self._fd = None
        self._pending: list[dict[str, Any]] = []  # remote: records not yet in the object
        self._last_time, self._last_examples = time.perf_counter(), None
        if not enabled:
            return
        paths.makedirs(workdir)
        truncate_records(self.path, start_step)
        if not paths.is_remote(self.path):
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if tensorboard:
            self._tb = summary_writer_class()(paths.join(workdir, TENSORBOARD_DIR),
                                     purge_step=start_step if start_step > 0 else None)
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step",
                             dynamic_ncols=True, mininterval=1.0)

    def write(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Appends whole records in one write; mirrors numeric values to TensorBoard."""
        if not self.enabled:
            return
        plain = [{k: plain_value(v) for k, v in r.items()} for r in records]
        if not plain:
            return
        if self._fd is None:
            self._pending += plain
        else:
            os.write(self._fd, "".join(json.dumps(r) + "\n" for r in plain).encode())
        if self._tb is not None:
            for r in plain:
                for k, v in r.items():
                    if "/" in k and isinstance(v, (int, float)) and not isinstance(v, bool):
                        self._tb.add_scalar(k, v, r["step"])
        self._update_bar(plain)

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
        if self._fd is None:
            append_records(self.path, self._pending)
            self._pending = []
        else:
            os.fsync(self._fd)
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flushes and closes the files and the bar."""
        if not self.enabled:
            return
        self.sync()
        if self._fd is not None:
            os.close(self._fd)
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        self.enabled = False


class CountBar:
    """A progress bar of finished units of a study (sweep trials, ramps, branch units): done /
    total, rate and ETA, on stderr; lines given to `log` appear above it.

    Args:
      total: units to run.
      unit: what one unit is called ("trial", "ramp", "unit").
      enabled: False turns the bar off (config.train.progress_bar; processes other than 0).
      log: where lines go (print: stdout, written around the bar).
      file: the bar's stream; no bar unless it is a terminal.
    """

    def __init__(self, total: int, *, unit: str = "trial", enabled: bool = True,
                 log: Callable[[str], Any] = print, file: Any = None):
        file = sys.stderr if file is None else file
        self._log, self._bar = log, None
        if enabled and total > 0 and file.isatty():
            from tqdm.auto import tqdm

            width = shutil.get_terminal_size().columns  # 80 where a terminal reports 0
            self._bar = tqdm(total=total, unit=unit, file=file, ncols=min(width, 120),
                             smoothing=0.1, mininterval=1.0)

    def log(self, line: str) -> None:
        """Prints a line (above the bar when there is one)."""
        if self._bar is not None and self._log is print:
            self._bar.write(line, file=sys.stdout)
        else:
            self._log(line)

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> CountBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
