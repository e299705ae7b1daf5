"""A sweep directory on disk: the trial records, their CSV export and the sweep definition.

Files in a sweep directory (all appended or replaced atomically; analysis reads only these):

- `sweep.json`: the sweep definition, base config and base trial grid ("trials"), written
  once the config has been validated (a later launch must match it, or pass `redefine`);
- `trials.jsonl`: one complete record per finished trial (see `TrialResult`); a record is
  written once, in one `write`, after the trial's last checkpoint; re-running skips it. A
  torn last line is cut off before the next append and a corrupt line is skipped with a
  warning naming its line (`cbs.results.records`): its trial counts as unfinished and reruns;
- `trials.csv`: the same records flattened to one row per (trial, target);
- `trials/<trial_id>/`: each trial's run directory (checkpoints, metrics.jsonl);
- `locks/`: one lock file per group of trials; a launcher holds it (fcntl) while it runs the
  group, so concurrent launchers into one directory share the work instead of repeating it.

The directory may be remote (`gs://bucket/sweep`, see `cbs.results.paths`). Object stores
have no locks: the lock files then live in a local directory (`lock_dir`), so launchers on
one machine still share the work, but launchers on several machines must not write into one
remote sweep directory at once (give each its own, or use a shared file-system mount).

Nothing is created until something is written, so a command that fails before its first
record leaves no directory behind.
"""

from __future__ import annotations

import csv
import dataclasses
import fcntl
import io
import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

from cbs.results import paths
from cbs.results import records as metrics
from cbs.results.paths import PathLike

TRIALS_FILE = "trials.jsonl"
CSV_FILE = "trials.csv"
SWEEP_FILE = "sweep.json"
GRID_FIELDS = ("batch_sizes", "learning_rates", "base_lr", "base_batch_size", "lr_rule",
               "lr_factors", "max_lr", "min_lr", "seeds", "extend_lr_rounds",
               "extend_lr_count")


@dataclasses.dataclass
class TrialResult:
    """What a finished trial records (one line of trials.jsonl).

    status: "done" (every target reached), "budget" (budget spent first), "diverged", or
    "dominated" (stopped once another learning rate at the same (B, seed) reached every
    target: its later crossings could not be the fastest).
    steps_to_target / examples_to_target: per target (as a string key), S and E = B·S at the
    first crossing of the progress metric, interpolated between evaluations; None if never.
    noise_at_target: per target, the noise statistics measured around the crossing
    (ratios of window averages, see `cbs.analysis.fit.noise_scale_at_crossing`).
    curve: {"step": [...], "examples": [...], metric: [...], "noise/...": [...]} at evals.
    """

    trial_id: str
    index: int
    batch_size: int
    learning_rate: float
    seed: int
    status: str
    target_metric: str
    steps_to_target: dict[str, float | None]
    examples_to_target: dict[str, float | None]
    noise_at_target: dict[str, dict[str, float]]
    final_steps: int
    final_metric: float
    curve: dict[str, list[float]]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def target_key(target: float) -> str:
    """The string a target loss is recorded under (stable, exact for typical values)."""
    return f"{float(target):g}"


class SweepStore:
    """The sweep directory: finished trial records and their CSV export."""

    def __init__(self, sweep_dir: PathLike):
        self.sweep_dir = os.fspath(sweep_dir)
        self.path = paths.join(sweep_dir, TRIALS_FILE)
        self.lock_dir = paths.local_lock_dir(sweep_dir)
        if paths.exists(sweep_dir) and not paths.isdir(sweep_dir):
            raise NotADirectoryError(f"sweep directory {sweep_dir} is a file; pass a "
                                     "directory (new or an earlier sweep's)")

    def _makedirs(self) -> None:
        paths.makedirs(self.sweep_dir)

    def trial_dir(self, trial: Any) -> str:
        """The run directory of a trial (anything with a `trial_id`)."""
        return paths.join(self.sweep_dir, "trials", trial.trial_id)

    def write_definition(self, definition: dict[str, Any], *, redefine: bool = False) -> None:
        """Keeps the first launch's definition; a later launch must match it.

        With `redefine`, a definition that changes only the grid (`GRID_FIELDS`: batch sizes,
        learning rates, seeds, extension rules) replaces it; finished trials that are still
        in the new grid keep their records, the others are ignored by the analysis. Any other
        change (model, budget, targets, ...) needs a new directory: its records would not mean
        the same thing.
        """
        path = paths.join(self.sweep_dir, SWEEP_FILE)
        previous = metrics.read_json(path)
        plain = json.loads(json.dumps(definition))
        if previous is None or previous.get("sweep") == plain.get("sweep"):
            if previous is None or "trials" not in previous:
                self._makedirs()
                metrics.write_json_atomic(path, plain)
            return
        if not redefine:
            raise ValueError(
                f"{path} holds a different sweep definition; rerun the original command to "
                "resume it, pass --redefine to change its grid, or use a new --sweep_dir.")
        changed = sorted(_changed_fields(previous, plain) - set(GRID_FIELDS))
        if changed:
            raise ValueError(
                f"--redefine changes only the grid ({', '.join(GRID_FIELDS)}); this config "
                f"also changes {', '.join(changed)}: use a new --sweep_dir.")
        metrics.write_json_atomic(path, plain)

    def claim(self, name: str, *, wait: bool = False) -> int | None:
        """Takes the lock `<lock_dir>/<name>.lock` (fcntl, released by `release` or when the
        process ends, kill -9 included); returns its descriptor, or None when another process
        holds it and `wait` is False. `lock_dir` is `locks/` in the sweep directory, or a
        local directory when that is remote (module docstring)."""
        os.makedirs(self.lock_dir, exist_ok=True)
        fd = os.open(os.path.join(self.lock_dir, f"{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    @staticmethod
    def release(fd: int) -> None:
        """Releases a lock taken by `claim`."""
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def definition(self) -> dict[str, Any] | None:
        return metrics.read_json(paths.join(self.sweep_dir, SWEEP_FILE))

    def records(self) -> list[dict[str, Any]]:
        """Finished trial records, first record per trial id (a repeated append is ignored)."""
        seen, out = set(), []
        for r in metrics.read_records(self.path, required=("trial_id", "index")):
            if r["trial_id"] not in seen:
                seen.add(r["trial_id"])
                out.append(r)
        return sorted(out, key=lambda r: r["index"])

    def finished_ids(self) -> set[str]:
        return {r["trial_id"] for r in self.records()}

    def append(self, results: Sequence[TrialResult]) -> None:
        """Appends complete records with a single write (all or none) and makes it durable."""
        self._makedirs()
        metrics.append_records(self.path, [r.to_json() for r in results])

    def export_csv(self) -> str:
        """Writes trials.csv (one row per trial and target) atomically; returns its path."""
        path = paths.join(self.sweep_dir, CSV_FILE)
        rows = list(_csv_rows(self.records()))
        self._makedirs()
        text = io.StringIO(newline="")
        fields = ["trial_id", "batch_size", "learning_rate", "seed", "status", "target",
                  "steps", "examples", "b_simple", "b_noise", "final_steps", "final_metric"]
        writer = csv.DictWriter(text, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
        metrics.write_atomic(path, text.getvalue())
        return path


def _changed_fields(old: dict[str, Any], new: dict[str, Any]) -> set[str]:
    """Sweep fields (by name) and other config fields (dotted) that differ."""
    old_sweep, new_sweep = old.get("sweep", {}), new.get("sweep", {})
    out = {k for k in set(old_sweep) | set(new_sweep) if old_sweep.get(k) != new_sweep.get(k)}

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix: d}
        items = {}
        for k, v in d.items():
            if prefix or k != "sweep":
                items |= flat(v, f"{prefix}{k}.")
        return items

    a, b = flat(old.get("config", {})), flat(new.get("config", {}))
    out |= {f"config.{k.rstrip('.')}" for k in set(a) | set(b) if a.get(k) != b.get(k)}
    return out


def _csv_rows(records: Iterable[dict[str, Any]]) -> Iterable[dict[str, Any]]:
    for r in records:
        for key, steps in r["steps_to_target"].items():
            noise_at = r["noise_at_target"].get(key, {})
            yield {
                "trial_id": r["trial_id"], "batch_size": r["batch_size"],
                "learning_rate": r["learning_rate"], "seed": r["seed"], "status": r["status"],
                "target": key, "steps": _blank(steps), "examples": _blank(
                    r["examples_to_target"][key]),
                "b_simple": _blank(noise_at.get("b_simple")),
                "b_noise": _blank(noise_at.get("b_noise")),
                "final_steps": r["final_steps"], "final_metric": r["final_metric"],
            }


def _blank(value: float | None) -> Any:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else value
