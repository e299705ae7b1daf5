"""The live side of a run (process 0 only): `MetricsWriter` appends records to `metrics.jsonl`
(format: `cbs.results.records`), mirrors their numbers to TensorBoard and W&B (`Outputs`) and
shows a progress bar; `CountBar` is the bar of a study's finished trials.

On an object store records are held until `sync` (before each checkpoint) or `close`. Bars go
through `tqdm.auto` (a widget in a notebook, a bar on a terminal); elsewhere (a Slurm or CI
log) `LogLines` prints a line in tqdm's format every `LOG_INTERVAL_S` seconds and at the end.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cbs.results import paths, records
from cbs.results.files import METRICS_FILE, WANDB_RUN_FILE
from cbs.results.paths import PathLike
from cbs.results.writers import (
    JsonlWriter,
    MultiWriter,
    TensorBoardWriter,
    WandbWriter,
    import_wandb,
    record_scalars,
    tensorboard_writer_class,
)
from cbs.runtime import fields

__all__ = [
    "LOG_INTERVAL_S", "TENSORBOARD_DIR", "CountBar", "LogLines", "MetricsWriter", "Outputs",
    "in_notebook", "progress_bar",
]

TENSORBOARD_DIR = "tensorboard"
LOG_INTERVAL_S = 30.0  # seconds between the progress lines of a log (`LogLines`)


def in_notebook() -> bool:
    """True in a Jupyter kernel (where `tqdm.auto` draws a widget)."""
    shell = sys.modules.get("IPython")
    get = getattr(shell, "get_ipython", None)
    ip = get() if get is not None else None
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


class LogLines:
    """A bar for logs with the part of tqdm's interface used here: a line in tqdm's format every
    `interval` seconds of updates, and one at `close`."""

    def __init__(self, total: int | None, *, unit: str = "it", initial: int = 0,
                 desc: str | None = None, file: Any = None, interval: float | None = None):
        self.total, self.n, self.unit, self.desc = total, initial, unit, desc
        self.interval = LOG_INTERVAL_S if interval is None else interval
        self._file, self._initial = file, initial
        self._start = self._last = time.monotonic()
        self._postfix: str | None = None
        self._closed = False

    def set_postfix(self, postfix: Mapping[str, Any], refresh: bool = False) -> None:
        del refresh
        self._postfix = ", ".join(f"{k}={v}" for k, v in postfix.items()) or None

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self._last >= self.interval:
            self._print()

    def _print(self) -> None:
        from tqdm.std import tqdm

        now = time.monotonic()
        line = tqdm.format_meter(self.n, self.total, now - self._start, prefix=self.desc or "",
                                 unit=self.unit, ascii=True, postfix=self._postfix,
                                 initial=self._initial)
        print(line, file=self._file if self._file is not None else sys.stderr, flush=True)
        self._last = now

    def write(self, line: str, file: Any = None) -> None:
        print(line, file=file if file is not None else sys.stdout)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._print()


def progress_bar(total: int | None, *, unit: str, initial: int = 0, desc: str | None = None,
                 leave: bool = True, file: Any = None, interval: float | None = None,
                 **tqdm_kwargs: Any) -> Any:
    """A `tqdm.auto` bar in a notebook or on a terminal, else `LogLines` (file: stderr default)."""
    stream = sys.stderr if file is None else file
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        tty = False
    if in_notebook() or tty:
        from tqdm.auto import tqdm

        try:
            return tqdm(total=total, initial=initial, unit=unit, desc=desc, leave=leave,
                        file=stream, **tqdm_kwargs)
        except ImportError:  # a notebook without ipywidgets: lines in the output instead
            pass
    return LogLines(total, unit=unit, initial=initial, desc=desc, file=stream, interval=interval)


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What a run shows and writes besides `metrics.jsonl` (on process 0): progress: a bar;
    tensorboard: events in `workdir/tensorboard`; wandb, wandb_group: the W&B project and group
    ("" = none); label: the bar's and the W&B run's name ("" = the run directory's); nested:
    a bar inside another one, not left behind when done."""

    progress: bool = True
    tensorboard: bool = False
    wandb: str = ""
    wandb_group: str = ""
    label: str = ""
    nested: bool = False

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> Outputs:
        """From `config.train` (progress_bar, tensorboard, wandb; `fields.ConfigError` for a
        W&B project that is not a string); `kwargs` set the rest."""
        t = config.train
        wandb = t.get("wandb", "")
        if not isinstance(wandb, str):
            raise fields.ConfigError(f'config.train.wandb: must be a W&B project name, or "" '
                                     f"for none, got {wandb!r}")
        return cls(progress=bool(t.progress_bar), tensorboard=bool(t.tensorboard),
                   wandb=wandb, **kwargs)

    def check(self) -> None:
        """An ImportError naming the extra when one the outputs need is missing."""
        if self.tensorboard:
            tensorboard_writer_class("config.train.tensorboard=True", "set it to False")
        if self.wandb:
            import_wandb("config.train.wandb", 'set it to ""')

    def open(self, workdir: PathLike, *, start_step: int = 0, total_steps: int | None = None,
             enabled: bool = True, hparams: Mapping[str, Any] | None = None) -> MetricsWriter:
        """The run's `MetricsWriter` with these outputs."""
        return MetricsWriter(workdir, start_step=start_step, total_steps=total_steps,
                             enabled=enabled, hparams=hparams, **dataclasses.asdict(self))


def _wandb_run_id(workdir: PathLike, start_step: int) -> str:
    """The W&B run id in `workdir`'s WANDB_RUN_FILE when it resumes, else a new one."""
    path = paths.join(workdir, WANDB_RUN_FILE)
    known = records.read_json(path) if start_step > 0 else None
    if known and known.get("id"):
        return str(known["id"])
    run_id = uuid.uuid4().hex[:16]
    records.write_json_atomic(path, {"id": run_id})
    return run_id


class MetricsWriter:
    """Appends a run's records to `metrics.jsonl`, mirrors them, shows a progress bar.

    start_step: the restored step (records at or after it are dropped first); total_steps: the
    bar's length; enabled: False on processes other than 0 (every method a no-op); progress
    ... nested: as `Outputs`; hparams: the run's config, for W&B."""

    def __init__(self, workdir: PathLike, *, start_step: int = 0,
                 total_steps: int | None = None, enabled: bool = True, progress: bool = True,
                 tensorboard: bool = False, wandb: str = "", wandb_group: str = "",
                 label: str = "", nested: bool = False, hparams: Mapping[str, Any] | None = None):
        self.path = paths.join(workdir, METRICS_FILE)
        self.jsonl: JsonlWriter | None = None
        self.mirrors = MultiWriter([])
        self._bar: Any = None
        self._last_time, self._last_examples = time.perf_counter(), None
        if not enabled:
            return
        Outputs(tensorboard=tensorboard, wandb=wandb).check()  # before any file
        self.jsonl = JsonlWriter(workdir, start_step=start_step)
        name = label or os.path.basename(str(workdir).rstrip("/"))
        if tensorboard:
            self.mirrors.writers.append(TensorBoardWriter(
                paths.join(workdir, TENSORBOARD_DIR),
                purge_step=start_step if start_step > 0 else None))
        if wandb:
            self.mirrors.writers.append(WandbWriter(
                wandb, name=name, group=wandb_group or None,
                run_id=_wandb_run_id(workdir, start_step), config=hparams))
        if progress:
            self._bar = progress_bar(total_steps, unit="step", initial=start_step,
                                     desc=label or None, leave=not nested,
                                     dynamic_ncols=True, mininterval=1.0)

    def write(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Appends whole records in one write; mirrors their numeric fields."""
        plain = [] if self.jsonl is None else self.jsonl.write_records(records)
        if not plain:
            return
        for r in plain:
            step, scalars = record_scalars(r)
            if scalars:
                self.mirrors.write_scalars(step, scalars)
        self._update_bar(plain)

    def _update_bar(self, records: list[dict[str, Any]]) -> None:
        """Advances the bar to the last step done (a train record's step too)."""
        if self._bar is None:
            return
        done = max(r["step"] + (r.get("kind") == "train") for r in records)
        train = [r for r in records if r.get("kind") == "train"]
        if train:
            last = train[-1]
            now = time.perf_counter()
            examples = last.get("data/examples_seen", 0) + last.get("data/batch_size", 0)
            postfix = {"loss": f"{last.get('train/loss', math.nan):.4g}"}
            if self._last_examples is not None and now > self._last_time:
                rate = (examples - self._last_examples) / (now - self._last_time)
                postfix["ex/s"] = f"{rate:.4g}"
            self._last_time, self._last_examples = now, examples
            self._bar.set_postfix(postfix, refresh=False)
        if self._bar.total is not None and done > self._bar.total:
            self._bar.total = None  # past the expected end (`KnowsItsEnd`): no ETA to give
        if done > self._bar.n:
            self._bar.update(done - self._bar.n)

    def sync(self) -> None:
        """Makes everything written so far durable (called before each checkpoint)."""
        if self.jsonl is None:
            return
        self.jsonl.flush()
        self.mirrors.flush()

    def close(self) -> None:
        """Flushes and closes the files, the W&B run and the bar."""
        if self.jsonl is None:
            return
        self.jsonl.close()
        self.mirrors.close()
        if self._bar is not None:
            self._bar.close()
        self.jsonl = None


class CountBar:
    """A `progress_bar` of a study's finished units (trials, ramps, branch units); `log` takes
    the lines to show (print: stdout, above the bar); file, interval: as `progress_bar`."""

    def __init__(self, total: int, *, unit: str = "trial", enabled: bool = True,
                 log: Callable[[str], Any] = print, file: Any = None,
                 interval: float | None = None):
        self._log, self._bar = log, None
        if enabled and total > 0:
            width = shutil.get_terminal_size().columns  # 80 where a terminal reports 0
            self._bar = progress_bar(total, unit=unit, file=file, interval=interval,
                                     ncols=min(width, 120), smoothing=0.1, mininterval=1.0)

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
