"""Batch-size ramps run beside a sweep and placed on its fitted S–E frontier.

A ramp is a `cbs.engine.trainer.run` whose `config.batch.schedule` changes B as examples are
seen (`cbs.engine.schedules`), the micro-batch fixed and the rate coupled to B
(`config.batch.lr_coupling`). Like a sweep trial it stops once the sweep's progress metric has
crossed every target, and records the steps S and examples E of each crossing (each
interpolated on its own axis: E ≠ B·S when B changes) in `ramps.jsonl`
(`cbs.results.shared.add_records`); `cbs.analysis.reports.report` draws them against the
frontier S = S_min + E_min/B.

The runs are `config.ramps`, a list of dicts (`RAMP_FIELDS`, described in
docs/guides/ramps.md); a `learning_rate` "best@B" is the sweep's fastest rate at B.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import jax
import ml_collections

from cbs import data, models
from cbs.analysis.fits import selection
from cbs.engine import config as config_lib
from cbs.engine import schedules, spec, trainer
from cbs.engine.lr import LR_RULES
from cbs.results import files, paths, records, shared
from cbs.results.store import SweepStore, definition_diff, describe, target_key
from cbs.runtime import fields, preemption
from cbs.runtime.fields import ConfigError
from cbs.runtime.writer import CountBar
from cbs.sweeps import grid, launch
from cbs.sweeps.trials import ProgressMonitor, curve_from_records, default_replicas

__all__ = [
    "RAMPS_DIR", "best_learning_rate", "check_ramps", "ramp_config", "ramp_overrides",
    "run_dir_name", "run_ramps", "validate_ramps",
]

RAMPS_DIR = "ramps"


def run_dir_name(label: str) -> str:
    """The directory name of a ramp run: its label in lower case, runs of anything but
    letters, digits, '.' and '-' as one '_' ("step (Llama 3)" -> "step_llama_3")."""
    return re.sub(r"[^a-z0-9.\-]+", "_", label.lower()).strip("_") or "ramp"


def _run_dir(out_dir: str, label: str) -> str:
    """A ramp's run directory; one named by the raw label (older sweeps) is kept."""
    name, legacy = run_dir_name(label), os.path.join(out_dir, RAMPS_DIR, label)
    return legacy if label != name and paths.isdir(legacy) else os.path.join(
        out_dir, RAMPS_DIR, name)


def best_learning_rate(sweep_dir: str, batch_size: int) -> float:
    """The sweep's learning rate with the fewest steps to its lowest reached target at B."""
    records = [r for r in SweepStore(sweep_dir).records() if r["batch_size"] == batch_size]
    if not records:
        raise ConfigError(f"config.ramps: no sweep trial at batch size {batch_size} in "
                         f"{sweep_dir}; run the sweep first or give a number")
    for key in sorted(records[0]["steps_to_target"], key=float):  # lowest target first
        reached = [r for r in records if r["steps_to_target"][key] is not None]
        if reached:
            return min(reached, key=lambda r: r["steps_to_target"][key])["learning_rate"]
    raise ConfigError(f"config.ramps: no trial at batch size {batch_size} reached a target")


def _learning_rate(spec: Any, sweep_dir: str) -> float:
    if isinstance(spec, str) and spec.startswith("best@"):
        return best_learning_rate(sweep_dir, int(spec[5:]))
    return float(spec)


# The fields of a config.ramps entry: the required ones, then the optional ones.
RAMP_REQUIRED = ("label", "schedule", "learning_rate")
_RAMP_INTEGERS = {"micro_batch": 1, "seed": 0, "eval_every": 1, "max_steps": 0,
                  "max_examples": 0, "adapt_every": 1}
_COUPLING_FIELDS = ("rule", "base_batch_size", "cap")
RAMP_FIELDS = (*RAMP_REQUIRED, "lr_coupling", "name", *_RAMP_INTEGERS)


def validate_ramps(config: ml_collections.ConfigDict, *, replicas: int | None = None) -> None:
    """Raises `ConfigError` naming `config.ramps[i].field` for a ramp that cannot run: a bad
    field, labels not unique as directory names, "best@B" at an unswept B, a run config the
    engine refuses with `replicas` data replicas (default: `config.mesh`'s)."""
    runs = config.get("ramps")
    if not isinstance(runs, (list, tuple)) or not runs:
        raise ConfigError("config.ramps: must be a non-empty list of ramps (dicts with "
                          f"{', '.join(RAMP_REQUIRED)}), got {runs!r}")
    sizes = sorted({int(b) for b in config.sweep.batch_sizes})
    replicas = default_replicas(config) if replicas is None else replicas
    for i, run in enumerate(runs):
        _validate_ramp(config, run, f"config.ramps[{i}]", sizes, replicas)
    labels = [run["label"] for run in runs]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"config.ramps: labels must be unique, got {labels}")
    names = [run_dir_name(label) for label in labels]
    if len(set(names)) != len(names):
        raise ConfigError(f"config.ramps: labels {labels} give clashing directory names {names};"
                          " make them differ in more than spaces and punctuation")


def _validate_ramp(config: ml_collections.ConfigDict, run: Any, at: str, sizes: list[int],
                   replicas: int) -> None:
    if not hasattr(run, "keys"):
        raise ConfigError(f"{at}: must be a dict with {', '.join(RAMP_REQUIRED)}, got {run!r}")
    if unknown := sorted(set(run.keys()) - set(RAMP_FIELDS)):
        raise ConfigError(f"{at}: unknown fields {unknown}; known: {list(RAMP_FIELDS)}")
    for field in ("label", "name"):
        if field in run or field == "label":
            value = fields.get(run, field, at)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"{at}.{field}: must be a non-empty string, got {value!r}")
    fields.check_section(run, at, integers=_RAMP_INTEGERS)
    schedule = fields.get(run, "schedule", at)
    try:
        schedules.batch_schedule_from_config(schedule)
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"{at}.schedule: {err}") from None
    lr = fields.get(run, "learning_rate", at)
    if isinstance(lr, str):
        best = re.fullmatch(r"best@(\d+)", lr)
        if best is None:
            raise ConfigError(f"{at}.learning_rate: must be a number > 0 or 'best@B' (B a swept "
                              f"batch size), got {lr!r}")
        if int(best[1]) not in sizes:
            raise ConfigError(f"{at}.learning_rate: {lr!r} names a batch size the sweep does "
                              f"not train (config.sweep.batch_sizes={sizes})")
    elif fields.finite(run, "learning_rate", at) <= 0:
        raise ConfigError(f"{at}.learning_rate: must be > 0, got {lr!r}")
    if "lr_coupling" in run:
        coupling, where = run["lr_coupling"], f"{at}.lr_coupling"
        if not hasattr(coupling, "keys") or set(coupling.keys()) - set(_COUPLING_FIELDS):
            raise ConfigError(f"{where}: must be a dict of {list(_COUPLING_FIELDS)}, got "
                              f"{coupling!r}")
        fields.choice(coupling, "rule", where, LR_RULES)
        fields.check_section(coupling, where, integers={"base_batch_size": 0})
        if "cap" in coupling:
            fields.number(coupling, "cap", where)
    if isinstance(lr, str):  # the sweep's best rate is read later; any rate checks the rest
        run = dict(run, learning_rate=float(config.optim.learning_rate))
    try:
        config_lib.validate(ramp_config(config, dict(run), ""), data_replicas=replicas,
                            model_names=models.model_names(),
                            dataset_names=data.known_datasets())
    except ConfigError as err:
        raise ConfigError(f"{at}: as a run, {err}") from None


def check_ramps(config: ml_collections.ConfigDict, sweep_dir: str, *,
                mesh: jax.sharding.Mesh | None = None) -> None:
    """Refuses ramps `validate_ramps` refuses, or a sweep directory of another config."""
    validate_ramps(config, replicas=None if mesh is None else int(mesh.shape["data"]))
    SweepStore(sweep_dir).check_definition(
        launch.sweep_definition(config, grid.make_trials(config.sweep)), "config.ramps")


def _check_recorded(done: dict[str, dict[str, Any]], run: dict[str, Any]) -> None:
    """Refuses a ramp recorded under this label with another spec (one without: accepted)."""
    old = done[run["label"]].get("spec")
    new = json.loads(json.dumps(run))
    if old is not None and old != new:
        diff = describe(definition_diff({"config": old}, {"config": new}) or ["its fields"])
        raise ConfigError(f"config.ramps: {run['label']!r} is recorded with a different spec "
                         f"({diff}); give the changed ramp a new label")


def ramp_overrides(config: ml_collections.ConfigDict, run: dict[str, Any], sweep_dir: str
                   ) -> spec.RunOverrides:
    """One ramp's run against the base config: its schedule, η_0 and coupling, the sweep's
    budget, an evaluation every `eval_every` (default 5) steps; the noise only where
    `noise.every` asks, on the step's examples."""
    sweep = config.sweep
    coupling = dict(run.get("lr_coupling", {"rule": "none"}))
    every = int(run.get("eval_every", 5))
    return spec.RunOverrides(
        schedule=dict(run["schedule"]),
        micro_batch=int(run.get("micro_batch", config.batch.micro_batch)),
        learning_rate=_learning_rate(run["learning_rate"], sweep_dir),
        seed=int(run.get("seed", config.seed)),  # seeded studies repeat a run over seeds
        lr_coupling=spec.Coupling(rule=coupling.get("rule", "none"),
                                  base_batch_size=int(coupling.get("base_batch_size", 0)),
                                  cap=float(coupling.get("cap", 0.0))),
        max_steps=int(run.get("max_steps", sweep.max_steps)),
        max_examples=int(run.get("max_examples", sweep.max_examples)),
        eval_every=every,
        adapt_every=int(run.get("adapt_every", config.batch.adapt_every)),
        full_train_eval=sweep.target_metric == "full_train/loss",
        log_every=min(config.train.log_every, every), quiet=True, noise_examples="step")


def ramp_config(config: ml_collections.ConfigDict, run: dict[str, Any], sweep_dir: str
                ) -> ml_collections.ConfigDict:
    """The run config of one ramp (`ramp_overrides` on the base, less its sweep and ramps)."""
    return spec.run_config(config, ramp_overrides(config, run, sweep_dir),
                           drop=("sweep", "ramps"))


def ramp_record(label: str, records: list[dict[str, Any]], sweep: ml_collections.ConfigDict,
                status: str, learning_rate: float) -> dict[str, Any]:
    """Steps and examples to each target (each interpolated on its own axis)."""
    metric = sweep.target_metric
    curve = curve_from_records(records, metric, sweep.loss_ema_decay)
    train_recs = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    steps_to, examples_to = ({target_key(t): selection.steps_to_target(curve[x], curve[metric], t)
                              for t in sweep.targets} for x in ("step", "examples"))
    return {
        "label": label, "status": status, "learning_rate": learning_rate,
        "target_metric": metric, "steps_to_target": steps_to, "examples_to_target": examples_to,
        "curve": {"step": curve["step"], "examples": curve["examples"],
                  metric: [v if math.isfinite(v) else None for v in curve[metric]]},
        "schedule": {"examples_seen": [r["data/examples_seen"] for r in train_recs],
                     "batch_size": [r["data/batch_size"] for r in train_recs],
                     "lr": [r["opt/lr"] for r in train_recs]},
    }


def run_ramps(config: ml_collections.ConfigDict, sweep_dir: str, *, log=print,
              mesh: jax.sharding.Mesh | None = None, out_dir: str | None = None
              ) -> list[dict[str, Any]]:
    """Runs (or resumes) every `config.ramps` run not in ramps.jsonl; returns all records.
    `mesh` defaults to `config.mesh`; `out_dir` (default: sweep_dir) holds the file and runs."""
    check_ramps(config, sweep_dir, mesh=mesh)
    out_dir = out_dir or sweep_dir
    paths.makedirs(out_dir)
    path = os.path.join(out_dir, files.RAMPS_FILE)
    done = {r["label"]: r for r in shared.read_merged(path, files.RAMP_KEYS)}
    runs = [dict(run) for run in config.ramps]
    for run in (r for r in runs if r["label"] in done):
        _check_recorded(done, run)  # the recorded spec must be the configured one
    todo = [run for run in runs if run["label"] not in done]
    enabled = bool(config.train.progress_bar) and jax.process_index() == 0
    with CountBar(len(todo), unit="ramp", enabled=enabled, log=log) as bar:
        for run in todo:
            preemption.check(f"before ramp {run['label']}")
            _run_ramp(config, run, sweep_dir, _run_dir(out_dir, run["label"]), path, bar.log, mesh)
            bar.update()
    shared.export_parts(path, files.RAMP_KEYS)  # on an object store, once for all runs
    return shared.read_merged(path, files.RAMP_KEYS)


def _run_ramp(config, run, sweep_dir, workdir, path, log, mesh) -> None:
    """Trains (or resumes) one ramp, adds its record to ramps.jsonl and logs its line."""
    c = ramp_config(config, run, sweep_dir)
    monitor = ProgressMonitor(config.sweep)
    summary = trainer.run(c, workdir, stop_fn=monitor, raise_on_divergence=False, mesh=mesh)
    recs = records.read_records(os.path.join(workdir, files.METRICS_FILE))
    status = "diverged" if summary["status"] == "diverged" or monitor.exploded else "done"
    rec = ramp_record(run["label"], recs, config.sweep, status, c.optim.learning_rate)
    rec["spec"] = json.loads(json.dumps(run))
    shared.add_records(path, files.RAMP_KEYS, [rec])
    cells = ", ".join(f"L={k}: S={'–' if s is None else f'{s:.0f}'}"
                      for k, s in rec["steps_to_target"].items())
    log(f"ramp {run['label']:<16s} η0={c.optim.learning_rate:.3g} {status}: {cells}")
