"""A sweep directory on disk: the trial records, their CSV export and the sweep definition.

Files in a sweep directory (all appended or replaced atomically; analysis reads only these):

- `sweep.json`: the sweep definition and base config of the first launch;
- `trials.jsonl`: one complete record per finished trial (see `TrialResult`); a record is
  written once, in one `write`, after the trial's last checkpoint; re-running skips it. A
  torn last line is cut off before the next append and a corrupt line is skipped with a
  warning naming its line (`cbs.results.records`): its trial counts as unfinished and reruns;
- `trials.csv`: the same records flattened to one row per (trial, target);
- `trials/<trial_id>/`: each trial's run directory (checkpoints, metrics.jsonl).

Nothing is created until something is written, so a command that fails before its first
record leaves no directory behind.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

from cbs.results import records as metrics

TRIALS_FILE = "trials.jsonl"
CSV_FILE = "trials.csv"
SWEEP_FILE = "sweep.json"


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

    def __init__(self, sweep_dir: str):
        self.sweep_dir = sweep_dir
        self.path = os.path.join(sweep_dir, TRIALS_FILE)
        if os.path.exists(sweep_dir) and not os.path.isdir(sweep_dir):
            raise NotADirectoryError(f"sweep directory {sweep_dir} is a file; pass a "
                                     "directory (new or an earlier sweep's)")

    def _makedirs(self) -> None:
        os.makedirs(self.sweep_dir, exist_ok=True)

    def trial_dir(self, trial: Any) -> str:
        """The run directory of a trial (anything with a `trial_id`)."""
        return os.path.join(self.sweep_dir, "trials", trial.trial_id)

    def write_definition(self, definition: dict[str, Any]) -> None:
        """Keeps the first launch's definition; a later launch must match it."""
        path = os.path.join(self.sweep_dir, SWEEP_FILE)
        previous = metrics.read_json(path)
        if previous is None:
            self._makedirs()
            metrics.write_json_atomic(path, definition)
            return
        if previous.get("sweep") != json.loads(json.dumps(definition.get("sweep"))):
            raise ValueError(
                f"{path} holds a different sweep definition; use a new --sweep_dir, or "
                "rerun the original command to resume it.")

    def definition(self) -> dict[str, Any] | None:
        return metrics.read_json(os.path.join(self.sweep_dir, SWEEP_FILE))

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
        path = os.path.join(self.sweep_dir, CSV_FILE)
        rows = list(_csv_rows(self.records()))
        self._makedirs()
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w", newline="") as f:
            fields = ["trial_id", "batch_size", "learning_rate", "seed", "status", "target",
                      "steps", "examples", "b_simple", "b_noise", "final_steps", "final_metric"]
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)
        return path


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
