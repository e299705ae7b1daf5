"""Metric writers: one small interface and its back ends.

`MetricWriter` has the shape of clu's metric writers; anything with `write_scalars` can stand
in for one. `JsonlWriter`: `metrics.jsonl`, the record of truth; `TensorBoardWriter` and
`WandbWriter` (optional extras): the mirrors, which get a record's numeric fields through
`record_scalars`; `MultiWriter`: the same calls to several.
"""

from __future__ import annotations

import abc
import json
import numbers
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cbs.results import paths
from cbs.results.extras import install_command
from cbs.results.files import METRICS_FILE
from cbs.results.paths import PathLike
from cbs.results.records import append_records, plain_value, truncate_records

__all__ = [
    "JsonlWriter", "MetricWriter", "MultiWriter", "TensorBoardWriter", "WandbWriter",
    "import_wandb", "record_scalars", "tensorboard_writer_class",
]


class MetricWriter(abc.ABC):
    """Writes scalars against a step; a context manager (or call `close`)."""

    @abc.abstractmethod
    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Writes `scalars` ({name: number}) at `step`."""

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:  # noqa: B027  # optional
        """Records the run's hyperparameters (a nested mapping); ignored by default."""

    def flush(self) -> None:  # noqa: B027  # optional: writers with no buffer
        """Makes everything written so far durable."""

    def close(self) -> None:
        """Flushes and releases the writer's files."""
        self.flush()

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _numbers(scalars: Mapping[str, Any]) -> dict[str, float]:
    """The numeric (not bool) values of `scalars` as floats (NumPy and JAX scalars too)."""
    plain = {k: plain_value(v) for k, v in scalars.items()}
    return {k: float(v) for k, v in plain.items()
            if isinstance(v, numbers.Real) and not isinstance(v, bool)}


def record_scalars(record: Mapping[str, Any]) -> tuple[int, dict[str, float]]:
    """(step, scalars) of a run's record for the mirrors: its numeric fields with a namespaced
    key ("train/loss"), suffixed with the trial of a group's record ("eval/loss/trial3")."""
    trial = record.get("trial")
    suffix = "" if trial is None else f"/trial{trial}"
    scalars = _numbers({k + suffix: v for k, v in record.items() if "/" in k})
    return int(record["step"]), scalars


class JsonlWriter(MetricWriter):
    """Appends records to `filename` in `workdir`, dropping those at or after `start_step`
    first; on an object store the records are held and written at `flush` and `close`."""

    def __init__(self, workdir: PathLike, *, start_step: int = 0,
                 filename: str = METRICS_FILE):
        self.path = paths.join(workdir, filename)
        self._fd: int | None = None
        self._pending: list[dict[str, Any]] = []  # remote: records not yet in the object
        paths.makedirs(workdir)
        truncate_records(self.path, start_step)
        if not paths.is_remote(self.path):
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write_records(self, records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Appends whole records (all in one write); returns them with plain values."""
        plain = [{k: plain_value(v) for k, v in r.items()} for r in records]
        if not plain:
            return plain
        if self._fd is None:
            self._pending += plain
        else:
            os.write(self._fd, "".join(json.dumps(r) + "\n" for r in plain).encode())
        return plain

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        self.write_records([{"step": int(step), **scalars}])

    def flush(self) -> None:
        if self._fd is None:
            if self._pending:
                append_records(self.path, self._pending)
            self._pending = []
        else:
            os.fsync(self._fd)

    def close(self) -> None:
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _missing(needed_by: str, package: str, extra: str, instead: str) -> ImportError:
    """The one-line ImportError of a missing extra: who needs it, how to install it."""
    return ImportError(f"{needed_by} needs {package}: {install_command(extra)}"
                       + (f" (or {instead})" if instead else ""))


def tensorboard_writer_class(needed_by: str = "Writing TensorBoard event files", instead: str = ""
                             ) -> type:
    """tensorboardX's SummaryWriter; an ImportError naming the extra when it is missing
    (`needed_by` and `instead` phrase it for the caller, e.g. a config field)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError as err:
        raise _missing(needed_by, "tensorboardX", "tensorboard", instead) from err
    return SummaryWriter


class TensorBoardWriter(MetricWriter):
    """TensorBoard event files in `logdir` (tensorboardX); `purge_step`: a resumed run's step
    (events at or after it written before are hidden)."""

    def __init__(self, logdir: PathLike, *, purge_step: int | None = None):
        self._writer = tensorboard_writer_class()(str(logdir), purge_step=purge_step)

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        for k, v in _numbers(scalars).items():
            self._writer.add_scalar(k, v, int(step))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        text = json.dumps(hparams, indent=1, sort_keys=True, default=str)
        self._writer.add_text("hparams", "```\n" + text + "\n```", 0)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def import_wandb(needed_by: str = "W&B logging", instead: str = "") -> Any:
    """The wandb module; an ImportError naming the [wandb] extra when it is missing."""
    try:
        import wandb
    except ImportError as err:
        raise _missing(needed_by, "wandb", "wandb", instead) from err
    return wandb


class WandbWriter(MetricWriter):
    """A Weights & Biases run: scalars as its history, hyperparameters as its config. Logs into
    `run`, one the caller started (`close` leaves it open), or starts one with
    `wandb.init(project, name, group, id=run_id, config, **init_kwargs)` (`close` finishes it;
    the same `run_id` continues it). W&B keeps one increasing step axis per run: scalars at a
    step below the last one written are not sent (a resume rewrites them)."""

    def __init__(self, project: str | None = None, *, run: Any = None, name: str | None = None,
                 group: str | None = None, run_id: str | None = None,
                 config: Mapping[str, Any] | None = None, **init_kwargs: Any):
        self._owned = run is None
        if run is None:
            wandb = import_wandb()
            # W&B's banner and summary (~14 stderr lines a run) silenced for one line said here
            init_kwargs.setdefault("settings", wandb.Settings(silent=True))
            run = wandb.init(project=project, name=name, group=group, id=run_id,
                             resume="allow" if run_id else None,
                             config=dict(config) if config else None, **init_kwargs)
            # where: its URL, or its local directory offline (where `wandb sync` uploads it)
            mode = getattr(getattr(run, "settings", None), "mode", None)
            where = (f"{mode}: {os.path.dirname(str(run.dir))}" if mode in ("offline", "disabled")
                     else str(getattr(run, "url", None) or ""))
            print(f"wandb: {run.name} ({where})", file=sys.stderr, flush=True)
        self.run = run
        self._last_step = -1
        self.dropped = 0  # scalars not sent: their step was below the last one written

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        values = _numbers(scalars)
        if not values:
            return
        if int(step) < self._last_step:
            self.dropped += len(values)
            return
        self._last_step = int(step)
        self.run.log(values, step=int(step))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self.run.config.update(dict(hparams), allow_val_change=True)

    def write_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                    summary: Mapping[str, Any] | None = None) -> None:
        """A `wandb.Table` under `key`, and `summary` scalars in the run's summary."""
        wandb = import_wandb()
        self.run.log({key: wandb.Table(columns=list(columns), data=[list(r) for r in rows])})
        for k, v in _numbers(summary or {}).items():
            self.run.summary[k] = v

    def close(self) -> None:
        if self._owned and self.run is not None:
            self.run.finish()
        self.run = None


class MultiWriter(MetricWriter):
    """Passes every call on to each of `writers` in turn."""

    def __init__(self, writers: Sequence[Any]):
        self.writers = list(writers)

    def _each(self, method: str, *args: Any) -> None:
        for w in self.writers:
            if hasattr(w, method):
                getattr(w, method)(*args)

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        for w in self.writers:  # the one method every writer has: a missing one is an error
            w.write_scalars(step, scalars)

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._each("write_hparams", hparams)

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")
