"""A sweep directory on disk (local or remote; the analysis reads only these files):

- `sweep.json`: the resolved config that determines the trials ("config"; its "sweep" section
  also at the top) and the base grid ("trials"); a later launch must match it
  (`SweepStore.write_definition`);
- `trials.d/`: one record per finished trial (`TrialResult`), each group that finishes
  together one write-once part (`cbs.results.shared`); a corrupt line is skipped with a
  warning and its trial reruns; `trials.jsonl`: older sweeps' records, then the parts' export;
  `trials.csv`: one row per (trial, target);
- `trials/<trial_id>/`: each trial's run directory; `locks/`: one claim per group of trials
  (`cbs.results.leases`), so concurrent launchers share the work.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from cbs.results import files, leases, paths, records, shared
from cbs.results.paths import PathLike

__all__ = [
    "MOVED_NOISE_FIELDS", "OUTPUT_FIELDS", "SweepStore", "TrialResult", "definition_diff",
    "describe", "flatten", "target_key",
]

GRID_FIELDS = ("batch_sizes", "learning_rates", "base_lr", "base_batch_size", "lr_rule",
               "lr_factors", "max_lr", "min_lr", "seeds", "extend_lr_rounds",
               "extend_lr_count")
# Config fields that change no record: output, profiling and checkpoint spacing (a resume is
# bit-identical whatever the spacing), and the sections of studies that read a sweep.
OUTPUT_FIELDS = ("train.progress_bar", "train.tensorboard", "train.wandb", "perf.peak_flops",
                 "perf.profile_start", "perf.profile_steps", "perf.compilation_cache_dir")
IGNORED_FIELDS = OUTPUT_FIELDS + ("train.checkpoint_every", "train.keep_checkpoints",
                                  "sweep.checkpoint_every_evals", "ramps", "branch")


@dataclasses.dataclass
class TrialResult:
    """What a finished trial records (one line of trials.jsonl). `status`: "done" (every target
    reached), "budget", "diverged", or "dominated" (stopped once another rate at the same
    (B, seed) reached every target first); `steps_to_target`, `examples_to_target`: per target
    (`target_key`), S and E = B·S at the first crossing of the progress metric, interpolated
    between evaluations (None: never); `noise_at_target`: per target, the noise statistics
    around the crossing; `curve`: {"step", "examples", metric, "noise/...": lists} at evals."""

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
    curve: dict[str, list[float | None]]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def target_key(target: float) -> str:
    """The string a target loss is recorded under (stable, exact for typical values)."""
    return f"{float(target):g}"


class SweepStore:
    """The sweep directory (module docstring)."""

    def __init__(self, sweep_dir: PathLike):
        self.sweep_dir = os.fspath(sweep_dir)
        self.path = paths.join(sweep_dir, files.TRIALS_FILE)
        self.lock_dir = paths.join(sweep_dir, "locks")
        self._read = shared.PartCache()  # on an object store, each part is fetched once
        if paths.exists(sweep_dir) and not paths.isdir(sweep_dir):
            raise NotADirectoryError(f"sweep directory {sweep_dir} is a file; pass a "
                                     "directory (new or an earlier sweep's)")

    def trial_dir(self, trial: Any) -> str:
        """The run directory of a trial (anything with a `trial_id`)."""
        return paths.join(self.sweep_dir, "trials", trial.trial_id)

    def write_definition(self, definition: dict[str, Any], *, redefine: bool = False) -> None:
        """Keeps the first launch's definition; a later one must match it on the fields both
        hold, `IGNORED_FIELDS` aside (`definition_diff`), or with `redefine` differ only in
        the grid (`GRID_FIELDS`, then it replaces it); else ValueError."""
        path = paths.join(self.sweep_dir, files.SWEEP_FILE)
        previous = records.read_json(path)
        plain = json.loads(json.dumps(definition))
        if previous is None:
            paths.makedirs(self.sweep_dir)
            records.write_json_atomic(path, plain)
            return
        changed = definition_diff(previous, plain)
        if not changed:
            if "trials" not in previous:
                records.write_json_atomic(path, plain)
            return
        grid = {f"sweep.{f}" for f in GRID_FIELDS}
        other = [c for c in changed if c.split(" ")[0] not in grid]
        if other:
            raise ValueError(f"{path} holds trials of a different config: {describe(other)}; "
                             "rerun with the original values, or use a new --sweep_dir")
        if not redefine:
            raise ValueError(f"{path} holds a different grid: {describe(changed)}; rerun the "
                             "original command to resume it, pass --redefine to change its "
                             "grid, or use a new --sweep_dir")
        records.write_json_atomic(path, plain)

    def check_definition(self, definition: dict[str, Any], reader: str) -> None:
        """ValueError naming `reader` when `definition` differs from the recorded one."""
        previous = self.definition()
        changed = definition_diff(previous, definition) if previous else []
        if changed:
            raise ValueError(f"{reader}: {paths.join(self.sweep_dir, files.SWEEP_FILE)} holds "
                             f"trials of a different config: {describe(changed)}; use the sweep's "
                             "config, or a new --sweep_dir")

    def claim(self, name: str, *, wait: bool = False) -> leases.Claim | None:
        """Takes the claim `name` in `locks/` (`cbs.results.leases.claim`)."""
        return leases.claim(self.lock_dir, name, wait=wait)

    release = staticmethod(leases.release)

    def claim_names(self) -> list[str]:
        """The names of the claims ever taken in this sweep (held or not)."""
        return leases.names(self.lock_dir)

    def definition(self) -> dict[str, Any] | None:
        return records.read_json(paths.join(self.sweep_dir, files.SWEEP_FILE))

    def records(self) -> list[dict[str, Any]]:
        """Finished trial records (the first per trial id), in index order."""
        out = shared.read_merged(self.path, ("trial_id",), required=("index",), cache=self._read)
        return sorted(out, key=lambda r: r["index"])

    def finished_ids(self) -> set[str]:
        return {r["trial_id"] for r in self.records()}

    def append(self, results: Sequence[TrialResult]) -> None:
        """Records finished trials as one write-once part (all or none)."""
        if not results:
            return
        paths.makedirs(self.sweep_dir)
        shared.write_part(self.path, shared.part_name([r.trial_id for r in results]),
                          [r.to_json() for r in results])

    def export(self) -> None:
        """Writes the exports trials.jsonl (earlier lines kept byte for byte) and trials.csv."""
        shared.export_parts(self.path, ("trial_id",), cache=self._read)
        self.export_csv()

    def export_csv(self) -> str:
        """Writes trials.csv (one row per trial and target) atomically; returns its path."""
        path = paths.join(self.sweep_dir, files.CSV_FILE)
        trial = ("trial_id", "batch_size", "learning_rate", "seed", "status")
        rows = [{k: r[k] for k in trial} | {
                 "target": key, "steps": _blank(steps),
                 "examples": _blank(r["examples_to_target"][key]),
                 "b_simple": _blank(r["noise_at_target"].get(key, {}).get("b_simple")),
                 "b_noise": _blank(r["noise_at_target"].get(key, {}).get("b_noise")),
                 "final_steps": r["final_steps"], "final_metric": r["final_metric"]}
                for r in self.records() for key, steps in r["steps_to_target"].items()]
        paths.makedirs(self.sweep_dir)
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=[*trial, "target", "steps", "examples",
                                                  "b_simple", "b_noise", "final_steps",
                                                  "final_metric"])
        writer.writeheader()
        writer.writerows(rows)
        records.write_atomic(path, text.getvalue())
        return path


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as {dotted name: leaf value} (lists are leaves)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out |= flatten(v, f"{prefix}.{k}" if prefix else str(k))
    return out


# Measurement settings that moved (config.<old> -> config.<new>): refused in a config
# (`cbs.engine.noise_spec.check_moved_keys`), read in their new place from older records.
MOVED_NOISE_FIELDS = {"sweep.noise_batch_size": "noise.batch_size",
                      "sweep.noise_hessian_batch_size": "noise.hessian_batch_size",
                      "sweep.noise_chunk_size": "noise.chunk_size",
                      "sweep.noise_examples": "noise.examples",
                      "sweep.noise_curvature_batch_size": "noise.deviations",
                      "sweep.noise_reference_deviations": "sweep.reference_noise.deviations",
                      "branch.noise_deviations": "branch.noise.deviations"}


def upgrade_noise_fields(config: dict[str, Any]) -> dict[str, Any]:
    """An old config with its moved measurement settings (`MOVED_NOISE_FIELDS`) in their
    current place (a copy): examples "sampled" reads "stream", noise_curvature_batch_size m
    reads deviations = m with curvature = m > 0, a reference m of 0 ("as the run's") None."""
    moved = [(old.split("."), new.split(".")) for old, new in MOVED_NOISE_FIELDS.items()
             if old.split(".")[1] in (config.get(old.split(".")[0]) or {})]
    if not moved:
        return config
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    out.setdefault("noise", {})
    for (section, old), new in moved:
        value = out[section].pop(old)
        if len(new) == 2:
            out[new[0]][new[1]] = value
        else:  # a study's own section
            out[new[0]][new[1]] = dict(out[new[0]].get(new[1]) or {}) | {new[2]: value or None}
    if out["noise"].get("examples") == "sampled":
        out["noise"]["examples"] = "stream"
    if any(old == "noise_curvature_batch_size" for (_, old), _ in moved):
        out["noise"]["curvature"] = out["noise"]["deviations"] > 0
    return out


def _config_of(definition: dict[str, Any], ignored: Sequence[str]) -> dict[str, Any]:
    """The flat config of a definition; an old one with only a "sweep" section gives that."""
    config = dict(definition.get("config") or {})
    if "sweep" in definition and "sweep" not in config:
        config["sweep"] = definition["sweep"]
    config = upgrade_noise_fields(config)
    return {k: v for k, v in flatten(config).items()
            if not any(k == f or k.startswith(f + ".") for f in ignored)}


def definition_diff(old: dict[str, Any], new: dict[str, Any],
                    ignored: Sequence[str] = IGNORED_FIELDS) -> list[str]:
    """The dotted fields both definitions hold whose values differ, as "name (old -> new)",
    sorted; the `ignored` fields (and below) never count."""
    a, b = (_config_of(json.loads(json.dumps(d)), ignored) for d in (old, new))
    return [f"{k} ({_short(a[k])} -> {_short(b[k])})" for k in sorted(set(a) & set(b))
            if a[k] != b[k]]


def describe(changed: Sequence[str], limit: int = 6) -> str:
    """At most `limit` differing fields, then how many more (one line)."""
    more = f" and {len(changed) - limit} more" if len(changed) > limit else ""
    return ", ".join(changed[:limit]) + more


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _blank(value: float | None) -> Any:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else value
