"""Several sweep trials as one program: the learning rates of one (B, seed), vmapped.

Trials that differ only in the peak rate η_0 (a value of the train state) are one state with a
leading axis K. `TrialGroup` drives the engine's loop (`cbs.engine.loop.Loop`) on one device
with a dispatch of many steps (`cbs.engine.vmapped.vmapped_steps`, a `fori_loop` of traced
length: the log grid of `cbs.sweeps.trials.eval_steps` costs no recompilation) and a vmapped
evaluation after each (the progress metric and `config.noise`'s measurement, as engine trials
record), until every trial has crossed the lowest target or diverged. Its run directory holds
the loop's files: one eval record per trial and evaluation in `metrics.jsonl` (step,
kind="eval", trial (its index), data/examples_seen, the progress metric, train/loss_ema,
noise/*), status.json and a checkpoint every `sweep.checkpoint_every_evals` evaluations; a
killed group resumes with an uninterrupted one's records.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from cbs.engine import spec
from cbs.engine.driver import Deferred, Restore
from cbs.engine.loop import Loop, ended_run
from cbs.engine.measure import state_measurement
from cbs.engine.noise_spec import NoiseSpec
from cbs.engine.parts import RunParts
from cbs.engine.state import TrainState
from cbs.engine.vmapped import vmapped_steps
from cbs.results import files, records
from cbs.results.store import SweepStore, TrialResult
from cbs.runtime import mesh, throughput
from cbs.runtime.progress import DivergenceRule
from cbs.runtime.writer import Outputs
from cbs.sweeps import trials as trials_lib
from cbs.sweeps.grid import Trial

__all__ = ["TrialGroup", "group_name"]

PROGRESS_SPLIT = {"full_train/loss": "train", "eval/loss": "eval"}


def group_name(trials: Sequence[Trial]) -> str:
    """A group's name (of its run directory and claim): shards never share one."""
    t = trials[0]
    return f"b{t.batch_size:06d}_s{t.seed}_t" + "-".join(str(x.index) for x in trials)


class TrialGroup:
    """K trials of one (B, seed) as one vmapped program (a `cbs.engine.loop.Driver`). `cache`:
    compilations and initial states shared by a sweep's groups; `noise`, `evals`,
    `checkpoint_every_evals` default to `config.noise` and the sweep's fields."""

    def __init__(self, config: ml_collections.ConfigDict, trials: Sequence[Trial],
                 store: SweepStore, *, cache: dict | None = None,
                 noise: NoiseSpec | None = None, evals: int | None = None,
                 checkpoint_every_evals: int | None = None):
        if len({(t.batch_size, t.seed) for t in trials}) != 1:
            raise ValueError("a trial group needs one batch size and one seed")
        self.sweep, self.trials = config.sweep, list(trials)
        self.checkpoint_every_evals = max(1, int(
            config.sweep.checkpoint_every_evals if checkpoint_every_evals is None
            else checkpoint_every_evals))
        self.store, self.workdir = store, os.path.join(store.sweep_dir, "groups",
                                                       group_name(trials))
        # the sweep's bar and mirrors (the run config is quiet)
        self.outputs = Outputs.from_config(
            config, label=os.path.basename(self.workdir), nested=True,
            wandb_group=os.path.basename(os.path.normpath(str(store.sweep_dir))))
        overrides = dataclasses.replace(
            trials_lib.trial_overrides(config, trials[0], replicas=1),
            noise_every=0,  # measured here, on separate batches, at each evaluation
            eval_enabled=True)  # every stop is an evaluation (progress and noise)
        c = spec.run_config(config, overrides)
        self.mesh = mesh.make_mesh(data=1, model=1, devices=jax.devices()[:1])
        self.parts = RunParts(c, mesh=self.mesh)
        self.noise = noise or self.parts.noise_spec
        if not self.parts.in_memory:
            raise ValueError(f"{self.parts.dataset.name} is streamed: set "
                             "config.sweep.vmap_trials=False to run its trials one by one")
        self.config, self.dataset, self.schedule = c, self.parts.dataset, self.parts.schedule
        self._rep = rep = mesh.replicated(self.mesh)
        (self.batch_size,) = self.schedule.batch_sizes()  # B: the run config's constant schedule
        self.steps = trials_lib.eval_steps(self.sweep, self.batch_size, evals)
        self._index = {s: j for j, s in enumerate(self.steps)}
        self.rule: DivergenceRule = trials_lib.divergence_rule(self.sweep)
        self._chunk = jax.jit(self._chunk_fn, donate_argnums=(0, 1),
                              in_shardings=(rep, rep, None), out_shardings=rep)
        # The evaluation does not depend on B: groups of one sweep share its compilation.
        self._cache = cache = {} if cache is None else cache
        key = ("evaluate", len(trials), self.trial_seed)
        if key not in cache:
            cache[key] = jax.jit(jax.vmap(self._evaluate_fn, in_axes=(0, 0, None)),
                                 in_shardings=(rep, rep, None), out_shardings=rep)
        self._evaluate_jit = cache[key]
        self._measure = state_measurement(self.noise, self.parts, seed=self.trial_seed)
        self.curve_keys = [f"noise/{k}" for k in trials_lib.NOISE_CURVE_KEYS]  # measured, per trial
        self.history: dict[str, Any] = {"evals": [], "seconds": 0.0}  # evaluations so far
        self._row: list[dict[str, Any]] = []  # the records of an evaluation being collected

    def _evaluate(self, states: TrainState, loss_ema: jax.Array, index: int
                  ) -> dict[str, jax.Array]:
        return self._evaluate_jit(states, loss_ema, jnp.asarray(index, jnp.int32))

    def _evaluate_fn(self, state: TrainState, loss_ema: jax.Array, index: jax.Array
                     ) -> dict[str, jax.Array]:
        """One trial's evaluation record fields (record keys)."""
        metric = self.sweep.target_metric
        split = PROGRESS_SPLIT.get(metric)
        out = {"noise/ema_b_simple": state.noise_ema.b_simple, "train/loss_ema": loss_ema}
        if split is not None:
            e = self.parts.config.eval
            fn, arrays = self.parts.eval_sums_fn(
                split, e.num_examples if split == "eval" else e.train_examples)
            sums = fn(state.params, state.model_state, arrays)
            out[metric] = sums["loss_sum"] / sums["count"]
        if self.noise.measures_at_evals:
            out |= {f"noise/{k}": v for k, v in self._measure(state, index).items()}
        return out

    def _chunk_fn(self, states: TrainState, loss_ema: jax.Array, num_steps: jax.Array
                  ) -> tuple[TrainState, jax.Array]:
        """`num_steps` steps of all K trials, carrying the EMA of each trial's batch loss."""
        tr = self.parts
        steps = vmapped_steps(tr.step.apply, tr.accum_steps(self.batch_size),
                              self.sweep.loss_ema_decay)  # the trials share the data
        states, loss_ema, _ = steps(states, tr.train_arrays, loss_ema, num_steps)
        return states, loss_ema

    @property
    def trial_seed(self) -> int:
        return self.trials[0].seed

    def start(self, restore: Restore | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """{"trials": K stacked states, "loss_ema": [K] (NaN: no loss yet)}, fresh at step 0
        (one initialisation per sweep and seed) or restored."""
        if restore is not None:
            shapes = jax.eval_shape(self._stacked, self.parts.abstract_state())
            return restore(jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self._rep), shapes))
        key = ("init", self.trial_seed)
        if key not in self._cache:
            self._cache[key] = self.parts.init_state()
        return self._stacked(self._cache[key]), {"step": 0, "examples_seen": 0}

    def _stacked(self, state: TrainState) -> dict[str, Any]:
        k = len(self.trials)
        states = jax.tree.map(lambda x: jnp.broadcast_to(x, (k, *x.shape)).copy(), state)
        lrs = jnp.asarray([t.learning_rate for t in self.trials], jnp.float32)
        return jax.device_put({"trials": states.replace(learning_rate=lrs),
                               "loss_ema": jnp.full((k,), jnp.nan, jnp.float32)}, self._rep)

    def advance(self, state: dict[str, Any], step: int, examples_seen: int, batch_size: int
                ) -> tuple[dict[str, Any], int, None]:
        """All K trials from `step` to the next evaluation, in one dispatch."""
        del examples_seen, batch_size
        n = self.steps[self._index[step] + 1] - step
        states, loss_ema = self._chunk(state["trials"], state["loss_ema"], jnp.int32(n))
        return {"trials": states, "loss_ema": loss_ema}, n, None

    def checkpoint_due(self, step: int) -> bool:
        j = self._index[step]
        return j > 0 and j % self.checkpoint_every_evals == 0

    def evaluation_due(self, step: int) -> bool:
        return step in self._index

    def evaluate_at(self, state: dict[str, Any], step: int) -> Deferred:
        """Every trial's evaluation: one record per trial (its `trial` index and values)."""
        values = self._evaluate(state["trials"], state["loss_ema"], self._index[step])
        return Deferred(values, lambda fetched: [
            {"trial": t.index} | {k: float(np.asarray(v)[i]) for k, v in fetched.items()}
            for i, t in enumerate(self.trials)])

    def num_compilations(self) -> int:
        return self._chunk._cache_size()  # type: ignore[attr-defined]  # not in jax's stub

    def expected_steps(self) -> int | None:
        """The step where the group should stop short of its budget (None: unknown)."""
        return None

    def _observe(self, step: int, record: dict[str, Any]) -> bool:
        """stop_fn of the loop: collects each evaluation's K records into `history`."""
        if record.get("kind") != "eval":
            return False
        if not self.history["evals"] and not self._row:  # a resumed run: what came before
            self._replay([r for r in records.read_records(
                os.path.join(self.workdir, files.METRICS_FILE)) if r["step"] < step])
        self._row.append(record)
        if len(self._row) < len(self.trials):
            return False
        self.history["evals"].append(_row_values(self._row))
        self._row = []
        return self._finished(self.history)

    def _replay(self, records: Sequence[dict[str, Any]]) -> None:
        k = len(self.trials)
        records = [r for r in records if r.get("kind") == "eval"]
        self.history["evals"] += [_row_values(records[j:j + k]) for j in range(0, len(records), k)]

    def run(self) -> list[TrialResult]:
        """Trains, resumes or (ended with this config) replays the group; a result per trial."""
        self.history, self._row = {"evals": [], "seconds": 0.0}, []
        summary = ended_run(self.workdir, self.config)
        if summary is not None:
            self._replay(records.read_records(os.path.join(self.workdir, files.METRICS_FILE)))
        else:
            summary = Loop(self, self._observe, points=self, read_each_evaluation=True,
                           end=self.expected_steps(), outputs=self.outputs,
                           perf=throughput.for_run(self.config, self.workdir, self.dataset,
                                                   self.mesh),
                           compilations=self.num_compilations).run()
        self.history["seconds"] = summary["elapsed_s"]
        return [self._result(i, t, self.history) for i, t in enumerate(self.trials)]

    def _metric_matrix(self, history) -> np.ndarray:
        """[evals, K] progress metric."""
        key = self.sweep.target_metric
        return np.stack([np.asarray(e[key], np.float64) for e in history["evals"]])

    @property
    def _skip(self) -> int:
        """Evaluations before the first progress value (no batch loss before step 1)."""
        return 1 if self.sweep.target_metric == "train/loss_ema" else 0

    def _finished(self, history) -> bool:
        """Every trial crossed the lowest target or diverged; or, with
        `sweep.stop_when_dominated`, one crossed it (the others can no longer be fastest)."""
        m = self._metric_matrix(history)[self._skip:]
        reached = np.any(m <= min(self.sweep.targets), axis=0)
        if self.sweep.stop_when_dominated and np.any(reached):
            return True
        bad = np.array([self.rule.scan(m[:, i]).diverged for i in range(m.shape[1])])
        return bool(np.all(reached | bad))

    def _result(self, i: int, trial: Trial, history) -> TrialResult:
        m = self._metric_matrix(history)[:, i]
        metric, skip = self.sweep.target_metric, self._skip
        status, keep = "budget", len(m)
        start = self.rule.first_bad(m[skip:])
        if start is not None:  # the curve ends where the divergence began
            status, keep = "diverged", skip + max(start, 1)
        steps = self.steps[skip:keep]
        curve: dict[str, list[float]] = {
            "step": list(steps), "examples": [s * self.batch_size for s in steps],
            metric: [float(v) for v in m[skip:keep]], "noise/step": list(self.steps[:keep])}
        for key in self.curve_keys:
            curve[key] = [float(np.asarray(e[key])[i]) if key in e else math.nan
                          for e in history["evals"][:keep]]
        values = [v for v in curve[metric] if math.isfinite(v)]
        if status != "diverged" and values and min(values) <= min(self.sweep.targets):
            status = "done"
        elif status == "budget" and len(history["evals"]) < len(self.steps):
            status = "dominated"  # stopped early: another learning rate reached every target
        return trials_lib.result_from_curve(trial, self.sweep, curve, status, history["seconds"])


def _row_values(records: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
    """One evaluation, {record key: [K] values}, from its K trial records (null reads NaN)."""
    keys = [k for k in records[0] if k not in ("step", "kind", "trial", "data/examples_seen")]
    return {k: np.asarray([math.nan if r.get(k) is None else r[k] for r in records], np.float64)
            for k in keys}
