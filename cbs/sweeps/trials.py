"""Running a sweep's trials and turning their records into `cbs.results.store.TrialResult`s.

Two back ends, same records: "engine", each trial a `cbs.engine.trainer.run` in its own run
directory (any model, dataset, mesh) stopped by `ProgressMonitor`; and "vmap"
(`cbs.sweeps.groups`), the rates of one (B, seed) as one vmapped program on in-memory data.
Both evaluate at `eval_steps` and measure the noise there (`config.noise`) on draws fixed by
(seed, evaluation index). A target's crossing step is interpolated between evaluations
(`cbs.analysis.fits.selection.steps_to_target`), its noise scale a ratio of window averages
around it (`selection.noise_scale_at_crossing`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections

from cbs.analysis.fits import selection
from cbs.engine import measure, spec, trainer
from cbs.engine.noise_spec import NoiseSpec
from cbs.results import files, records
from cbs.results.store import SweepStore, TrialResult, target_key
from cbs.runtime import progress
from cbs.runtime.fields import ConfigError
from cbs.runtime.writer import Outputs
from cbs.stats import sampled
from cbs.sweeps.grid import Trial

__all__ = [
    "NOISE_CURVE_KEYS", "ProgressMonitor", "curve_from_records", "default_replicas",
    "divergence_rule", "eval_every", "eval_steps", "micro_batch_for", "result_from_curve",
    "run_trial_engine", "step_budget", "summarize", "trial_config", "trial_overrides",
]

# The noise statistics of a trial's curve: the evaluation's (less mean_*) and the live EMA.
NOISE_CURVE_KEYS = tuple(k for k in measure.EVAL_KEYS if not k.startswith("mean_")) + (
    "ema_b_simple",)


def divergence_rule(sweep: ml_collections.ConfigDict) -> progress.DivergenceRule:
    """`sweep.divergence_factor` and `divergence_patience` (evaluations) as a rule."""
    return progress.DivergenceRule(float(sweep.divergence_factor),
                                   int(sweep.get("divergence_patience", 1)))


def step_budget(sweep: ml_collections.ConfigDict, batch_size: int) -> int:
    """Steps a trial may take: the smaller of max_steps and ceil(max_examples / B)."""
    budgets = (int(sweep.max_steps), -(-int(sweep.max_examples) // batch_size))
    return max(1, min(b for b in budgets if b))


def eval_steps(sweep: ml_collections.ConfigDict, batch_size: int, evals: int | None = None
               ) -> list[int]:
    """0, then `evals` (default `sweep.evals_per_trial`) steps evenly spaced in log(step) up to
    the budget (a crossing's relative resolution is the same at step 30 and 3000)."""
    return progress.log_spaced_steps(step_budget(sweep, batch_size),
                                     int(sweep.evals_per_trial if evals is None else evals))


def eval_every(sweep: ml_collections.ConfigDict, batch_size: int) -> int:
    """Steps between progress evaluations (dense: `evals_per_trial` over the budget)."""
    return max(1, step_budget(sweep, batch_size) // int(sweep.evals_per_trial))


def micro_batch_for(batch_size: int, micro_batch: int, replicas: int) -> int:
    """The largest m ≤ micro_batch with B divisible by m·R (so A = B/(m·R) is whole)."""
    if batch_size % replicas:
        raise ConfigError(f"config.sweep.batch_sizes: {batch_size} is not divisible by the "
                         f"{replicas} data replicas of the mesh")
    per_replica = batch_size // replicas
    return max(d for d in range(1, min(micro_batch, per_replica) + 1) if per_replica % d == 0)


def trial_overrides(config: ml_collections.ConfigDict, trial: Trial, *, replicas: int = 1
                    ) -> spec.RunOverrides:
    """One trial's run against the base config: (B, η, seed), the sweep's budget and
    `eval_steps`; the noise is measured at the evaluations, not in the step."""
    sweep = config.sweep
    every = eval_every(sweep, trial.batch_size)
    noise = NoiseSpec.of(config)
    return spec.RunOverrides(
        batch_size=trial.batch_size,
        micro_batch=micro_batch_for(trial.batch_size, config.batch.micro_batch, replicas),
        learning_rate=trial.learning_rate, seed=trial.seed,
        lr_coupling=spec.Coupling(rule="none"),
        max_steps=step_budget(sweep, trial.batch_size), max_examples=0,
        eval_every=every, eval_steps=tuple(eval_steps(sweep, trial.batch_size)),
        full_train_eval=sweep.target_metric == "full_train/loss",
        log_every=min(config.train.log_every, every), quiet=True,
        divergence_factor=0.0,  # the sweep's rule decides, on the progress metric
        eval_enabled=True if noise.measures_at_evals else None,  # the noise is measured there
        noise_every=0 if noise.every or noise.measures_at_evals else None)


def trial_config(config: ml_collections.ConfigDict, trial: Trial, *, replicas: int = 1
                 ) -> ml_collections.ConfigDict:
    """The run config of one trial (`trial_overrides` on the base config, less its sweep)."""
    return spec.run_config(config, trial_overrides(config, trial, replicas=replicas))


class ProgressMonitor:
    """stop_fn of `cbs.train.run`: stops once the progress metric hit every target or diverged."""

    def __init__(self, sweep: ml_collections.ConfigDict):
        self.metric, self.lowest_target = sweep.target_metric, min(sweep.targets)
        self.ema_decay, self.rule = sweep.loss_ema_decay, divergence_rule(sweep)
        self.ema = math.nan
        self.state = progress.DivergenceState()

    @property
    def exploded(self) -> bool:
        return self.state.diverged

    def value(self, record: dict[str, Any]) -> float | None:
        if self.metric == "train/loss_ema":
            if record.get("kind") != "train" or "train/loss" not in record:
                return None
            self.ema = progress.ema_update(self.ema, float(record["train/loss"]), self.ema_decay)
            return self.ema
        return record.get(self.metric)

    def __call__(self, step: int, record: dict[str, Any]) -> bool:
        v = self.value(record)
        if v is None:
            return False
        self.state = self.rule.update(self.state, v)
        return self.state.diverged or v <= self.lowest_target


def curve_from_records(records: Sequence[dict[str, Any]], metric: str, ema_decay: float
                       ) -> dict[str, list[float]]:
    """The progress curve (step, examples, metric) and the noise statistics measured at the
    evaluations (older runs: at measured steps) from a run's metrics.jsonl records."""
    records = sorted(records, key=lambda r: (r["step"], r["kind"] != "train"))
    if metric == "train/loss_ema":
        rows = [r for r in records if r["kind"] == "train"]
        curve: dict[str, list[float]] = {
            "step": [r["step"] + 1 for r in rows],  # the loss after the step
            "examples": [r["data/examples_seen"] + r["data/batch_size"] for r in rows],
            metric: progress.ema_curve([r["train/loss"] for r in rows], ema_decay)}
    else:
        rows = [r for r in records if r["kind"] == "eval" and metric in r]
        curve = {"step": [r["step"] for r in rows],
                 "examples": [r["data/examples_seen"] for r in rows],
                 metric: [r[metric] for r in rows]}
    noise_recs = [r for r in records if r["kind"] == "eval" and "noise/trace_sigma" in r]
    if not noise_recs:
        noise_recs = [r for r in records if r["kind"] == "train" and "noise/trace_sigma" in r
                      and math.isfinite(r["noise/trace_sigma"])]
    curve["noise/step"] = [r["step"] for r in noise_recs]
    for k in NOISE_CURVE_KEYS:
        curve[f"noise/{k}"] = [r.get(f"noise/{k}", math.nan) for r in noise_recs]
    return curve


def result_from_curve(trial: Trial, sweep: ml_collections.ConfigDict,
                      curve: dict[str, list[float]], status: str, seconds: float) -> TrialResult:
    """Steps, examples and measured noise scale at each target from a progress curve."""
    metric = sweep.target_metric
    steps_to, examples_to, noise_at = {}, {}, {}
    for target in sweep.targets:
        key = target_key(target)
        s = None if status == "diverged" and not curve[metric] else selection.steps_to_target(
            curve["step"], curve[metric], target)
        steps_to[key] = s
        examples_to[key] = None if s is None else s * trial.batch_size
        noise_at[key] = {} if s is None else _noise_at(curve, s, sweep.noise_window)
    final = curve[metric][-1] if curve[metric] else math.nan
    return TrialResult(
        trial_id=trial.trial_id, index=trial.index, batch_size=trial.batch_size,
        learning_rate=trial.learning_rate, seed=trial.seed, status=status,
        target_metric=metric, steps_to_target=steps_to, examples_to_target=examples_to,
        noise_at_target=noise_at,
        final_steps=int(curve["step"][-1]) if curve["step"] else 0,
        final_metric=float(final), seconds=seconds,
        curve={k: [float(v) if v is not None and math.isfinite(v) else None for v in vals]
               for k, vals in curve.items()})


def _noise_at(curve: dict[str, list[float]], crossing: float, window: int) -> dict[str, float]:
    x = curve.get("noise/step", [])
    if not x:
        return {}
    kw: dict[str, Any] = {"min_points": window, "window": 0.0}
    out: dict[str, Any] = {"b_simple": selection.noise_scale_at_crossing(
        x, curve["noise/trace_sigma"], curve["noise/grad_sq_norm"], crossing, **kw)}
    if any(math.isfinite(v) for v in curve.get("noise/trace_h_sigma", [])):
        # window averages of both, over the measurements where both are finite (those
        # `selection.noise_scale_at_crossing` divides)
        num, den = curve["noise/trace_h_sigma"], curve["noise/g_h_g"]
        ok = [i for i in range(len(x)) if math.isfinite(num[i]) and math.isfinite(den[i])]
        b_noise, why = sampled.resolve_b_noise(*(selection.noise_scale_at_crossing(
            [x[i] for i in ok], [v[i] for i in ok], [1.0] * len(ok), crossing, **kw)
            for v in (num, den)))
        if b_noise is None:
            out["b_noise_unresolved"] = why
        else:
            out["b_noise"] = b_noise
    ema = [(abs(s - crossing), v) for s, v in zip(x, curve["noise/ema_b_simple"], strict=True)
           if math.isfinite(v)]
    if ema:
        out["ema_b_simple"] = float(min(ema)[1])
    return {k: v for k, v in out.items() if isinstance(v, str) or math.isfinite(v)}


def run_trial_engine(config: ml_collections.ConfigDict, trial: Trial, store: SweepStore, *,
                     mesh: jax.sharding.Mesh | None = None) -> TrialResult:
    """Runs (or resumes) one trial with `cbs.engine.trainer.run` in its trial directory."""
    sweep, workdir, monitor = config.sweep, store.trial_dir(trial), ProgressMonitor(config.sweep)
    replicas = mesh.shape["data"] if mesh is not None else default_replicas(config)
    c = trial_config(config, trial, replicas=replicas)
    start = time.perf_counter()
    outputs = Outputs.from_config(  # the sweep's bar and mirrors (the trial's config is quiet)
        config, label=trial.trial_id, nested=True,
        wandb_group=os.path.basename(os.path.normpath(str(store.sweep_dir))))
    summary = trainer.run(c, workdir, stop_fn=monitor, raise_on_divergence=False, mesh=mesh,
                          outputs=outputs)
    recs = records.read_records(f"{workdir}/{files.METRICS_FILE}")
    curve = curve_from_records(recs, sweep.target_metric, sweep.loss_ema_decay)
    for r in recs:  # a resumed monitor has not seen the records before the restart
        monitor(r["step"], r)
    values = [v for v in curve[sweep.target_metric] if v is not None]
    status = ("diverged" if summary["status"] == "diverged" or monitor.exploded else
              "done" if values and min(values) <= min(sweep.targets) else "budget")
    return result_from_curve(trial, sweep, curve, status, time.perf_counter() - start)


def default_replicas(config: ml_collections.ConfigDict) -> int:
    """The data replicas of `config.mesh` on this host's devices."""
    n = config.mesh
    return jax.device_count() // max(1, n.model) if n.data == -1 else int(n.data)


def summarize(results: Sequence[TrialResult]) -> str:
    """One line per trial: B, η, status and steps to each target."""
    return "\n".join(
        f"B={r.batch_size:<6d} lr={r.learning_rate:.3g}  {r.status:<8s} steps "
        + ", ".join(f"L={k}: {'–' if s is None else f'{s:.0f}'}"
                    for k, s in r.steps_to_target.items()) + f"  ({r.seconds:.1f} s)"
        for r in results)
