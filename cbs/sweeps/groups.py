"""Several sweep trials as one program: the learning rates of one (B, seed), vmapped.

Trials that differ only in the peak learning rate η_0 share everything static: model, batch
size, data order. `cbs.engine.step.TrainState` holds η_0 as a value, so K such trials are one
state with a leading axis K, and the engine's own step (`cbs.engine.step.TrainStep`) runs on it
under `vmap`: one compilation per batch size, one dispatch per evaluation interval (a
`fori_loop` whose length is a value, so the log-spaced evaluation grid of
`cbs.sweeps.trials.eval_steps` costs no recompilation), the data gathered on the device from the
stream of `cbs.data`. After each interval: the progress metric (the full training-set loss,
the eval-split loss, or the EMA of the batch loss carried through the loop) and an exact
noise measurement per trial (`cbs.engine.measure`: B_simple on a fresh batch of
`sweep.noise_batch_size` training examples; for B_noise, the deviations of its first
`sweep.noise_curvature_batch_size` examples and the Hessian of an independent draw of
`sweep.noise_hessian_batch_size` examples, so the estimate is unbiased). Divergence and the
loss EMA are `cbs.engine.progress`'s, as in single runs.

The group runs on one device (small models: the vmap is the parallelism). It checkpoints the
stacked state and the curves so far every `sweep.checkpoint_every_evals` evaluations
(`cbs.engine.checkpoint`); a killed group resumes from there and ends with the same records as an
uninterrupted one.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from cbs.engine import checkpoint, measure, mesh
from cbs.engine import trainer as train
from cbs.engine.progress import DivergenceRule, ema_update
from cbs.engine.step import TrainState
from cbs.results.store import SweepStore, TrialResult
from cbs.sweeps.grid import Trial
from cbs.sweeps.trials import (
    NOISE_CURVE_KEYS,
    divergence_rule,
    eval_steps,
    result_from_curve,
    trial_config,
)

PROGRESS_SPLIT = {"full_train/loss": "train", "eval/loss": "eval"}


def group_dir(store: SweepStore, trials: Sequence[Trial]) -> str:
    """The group's run directory, named by its trials (shards never share one)."""
    t = trials[0]
    ids = "-".join(str(x.index) for x in trials)
    return os.path.join(store.sweep_dir, "groups", f"b{t.batch_size:06d}_s{t.seed}_t{ids}")


def sweep_measurement(sweep: ml_collections.ConfigDict, loss_fn, params, dataset, arrays,
                      index: Any, *, seed: int) -> dict[str, jax.Array]:
    """The noise measurement a sweep trial records at its `index`-th evaluation (jittable):
    `cbs.engine.measure.measure_noise` on `sweep.noise_batch_size` examples of a measurement
    stream (`seed`) and, when `sweep.noise_curvature_batch_size` > 0, B_noise from the
    deviations of that many of them and the Hessian of an independent draw of
    `sweep.noise_hessian_batch_size` examples."""
    curv = int(sweep.noise_curvature_batch_size)
    grad_batch, hess_batch = measure.measurement_batches(
        dataset, arrays, index, seed=seed, batch_size=int(sweep.noise_batch_size),
        hessian_batch_size=int(sweep.noise_hessian_batch_size) if curv else 0)
    out = measure.measure_noise(loss_fn, params, grad_batch, hess_batch, deviations=curv,
                                chunk_size=int(sweep.noise_chunk_size) or None)
    out.pop("mean_grad_sq_norm")
    return out


class TrialGroup:
    """K trials with the same batch size and seed, trained as one vmapped program."""

    def __init__(self, config: ml_collections.ConfigDict, trials: Sequence[Trial],
                 store: SweepStore, *, cache: dict | None = None):
        if len({(t.batch_size, t.seed) for t in trials}) != 1:
            raise ValueError("a trial group needs one batch size and one seed")
        self.config, self.sweep, self.trials = config, config.sweep, list(trials)
        self.store, self.workdir = store, group_dir(store, trials)
        c = trial_config(config, trials[0], replicas=1)
        c.noise.every = 0  # measured here, on separate batches, at each evaluation
        one_device = mesh.make_mesh(data=1, model=1, devices=jax.devices()[:1])
        self.trainer = train.Trainer(c, None, mesh=one_device)
        self._rep = mesh.replicated(one_device)
        if not self.trainer.in_memory:
            raise ValueError(f"{self.trainer.dataset.name} is streamed: set "
                             "config.sweep.vmap_trials=False to run its trials one by one")
        self.batch_size = trials[0].batch_size
        self.steps = eval_steps(self.sweep, self.batch_size)
        self.rule: DivergenceRule = divergence_rule(self.sweep)
        rep = self._rep
        self._chunk = jax.jit(self._chunk_fn, donate_argnums=(0, 1),
                              in_shardings=(rep, rep, None), out_shardings=rep)
        # The evaluation does not depend on B: groups of one sweep share its compilation.
        cache = {} if cache is None else cache
        key = ("evaluate", len(trials), self.trial_seed)
        if key not in cache:
            cache[key] = jax.jit(jax.vmap(self._evaluate_fn, in_axes=(0, 0, None)),
                                 in_shardings=(rep, rep, None), out_shardings=rep)
        self._evaluate_jit = cache[key]

    # ------------------------------------------------------------------ device programs

    def _evaluate(self, states: TrainState, loss_ema: jax.Array, index: int
                  ) -> dict[str, jax.Array]:
        """Progress metric and noise measurement of every trial (the `index`-th evaluation)."""
        return self._evaluate_jit(states, loss_ema, jnp.asarray(index, jnp.int32))

    def _measure(self, state: TrainState, index: jax.Array) -> dict[str, jax.Array]:
        """Noise statistics of one trial at its `index`-th measurement (`sweep_measurement`)."""
        tr = self.trainer
        loss_fn = lambda p, b: tr.loss_fn(p, state.model_state, b)[0]
        return sweep_measurement(self.sweep, loss_fn, state.params, tr.dataset,
                                 tr.train_arrays, index, seed=self.trial_seed)

    def _evaluate_fn(self, state: TrainState, loss_ema: jax.Array, index: jax.Array
                     ) -> dict[str, jax.Array]:
        split = PROGRESS_SPLIT.get(self.sweep.target_metric)
        out = {"ema_b_simple": state.noise_ema.b_simple, "loss_ema": loss_ema}
        if split is not None:
            e = self.trainer.config.eval
            fn, arrays = self.trainer.eval_sums_fn(
                split, e.num_examples if split == "eval" else e.train_examples)
            sums = fn(state.params, state.model_state, arrays)
            out["metric"] = sums["loss_sum"] / sums["count"]
        return out | (self._measure(state, index) if self.sweep.noise_batch_size else {})

    def _chunk_fn(self, states: TrainState, loss_ema: jax.Array, num_steps: jax.Array
                  ) -> tuple[TrainState, jax.Array]:
        """`num_steps` steps of all K trials, carrying the EMA of each trial's batch loss."""
        tr, decay = self.trainer, self.sweep.loss_ema_decay
        accum = tr.accum_steps(self.batch_size)

        def one(state, ema):
            def body(_, carry):
                s, e = carry
                s, m = tr.step.apply(s, tr.train_arrays, accum)
                return s, ema_update(e, m["train/loss"], decay)

            return jax.lax.fori_loop(0, num_steps, body, (state, ema))

        return jax.vmap(one)(states, loss_ema)

    # ------------------------------------------------------------------ host loop

    @property
    def trial_seed(self) -> int:
        return self.trials[0].seed

    def _init_states(self) -> TrainState:
        state = self.trainer.init_state()
        k = len(self.trials)
        states = jax.tree.map(lambda x: jnp.broadcast_to(x, (k, *x.shape)).copy(), state)
        lrs = jnp.asarray([t.learning_rate for t in self.trials], jnp.float32)
        return jax.device_put(states.replace(learning_rate=lrs), self._rep)

    def _abstract_states(self) -> TrainState:
        shapes = jax.eval_shape(self._init_states)
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self._rep),
                            shapes)

    def run(self) -> list[TrialResult]:
        """Trains (or resumes) the group to the end; returns one result per trial."""
        start = time.perf_counter()
        ckpt = checkpoint.Checkpointer(os.path.join(self.workdir, checkpoint.CHECKPOINT_DIR),
                                       max_to_keep=1)
        history: dict[str, Any] = {"evals": [], "seconds": 0.0}
        k = len(self.trials)
        latest = ckpt.latest_step()
        if latest is None:
            states = self._init_states()
            loss_ema = jax.device_put(jnp.full((k,), jnp.nan, jnp.float32), self._rep)
            history["evals"].append(jax.device_get(self._evaluate(states, loss_ema, 0)))
        else:
            states, meta = ckpt.restore(latest, self._abstract_states())
            history = _history_from_json(meta)
            loss_ema = jax.device_put(history["evals"][-1]["loss_ema"], self._rep)
        every_ckpt = max(1, int(self.sweep.checkpoint_every_evals))
        try:  # an interrupted group still finishes writing the checkpoint it started
            while len(history["evals"]) < len(self.steps) and not self._finished(history):
                j = len(history["evals"])
                states, loss_ema = self._chunk(states, loss_ema,
                                               jnp.int32(self.steps[j] - self.steps[j - 1]))
                history["evals"].append(jax.device_get(self._evaluate(states, loss_ema, j)))
                if j % every_ckpt == 0 or self._finished(history):
                    history["seconds"] += time.perf_counter() - start
                    start = time.perf_counter()
                    # loss_ema is restored from the history (its last evaluation holds it)
                    ckpt.save(self.steps[j], states, _history_to_json(history))
        finally:
            ckpt.close()
        history["seconds"] += time.perf_counter() - start
        return [self._result(i, t, history) for i, t in enumerate(self.trials)]

    def _metric_matrix(self, history) -> np.ndarray:
        """[evals, K] progress metric."""
        key = "loss_ema" if self.sweep.target_metric == "train/loss_ema" else "metric"
        return np.stack([np.asarray(e[key], np.float64) for e in history["evals"]])

    @property
    def _skip(self) -> int:
        """Evaluations before the first progress value (no batch loss before step 1)."""
        return 1 if self.sweep.target_metric == "train/loss_ema" else 0

    def _finished(self, history) -> bool:
        """Every trial crossed the lowest target or diverged (`cbs.engine.progress`); or, with
        `sweep.stop_when_dominated`, one trial crossed it: every crossing the others could
        still make comes later than that trial's, so none of them can be the fastest."""
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
            metric: [float(v) for v in m[skip:keep]]}
        evals = history["evals"][:keep]
        curve["noise/step"] = list(self.steps[:keep])
        for k in NOISE_CURVE_KEYS:
            curve[f"noise/{k}"] = [float(np.asarray(e[k])[i]) if k in e else math.nan
                                   for e in evals]
        values = [v for v in curve[metric] if math.isfinite(v)]
        if status != "diverged" and values and min(values) <= min(self.sweep.targets):
            status = "done"
        elif status == "budget" and len(history["evals"]) < len(self.steps):
            status = "dominated"  # stopped early: another learning rate reached every target
        return result_from_curve(trial, self.sweep, curve, status, history["seconds"])


def _history_to_json(history) -> dict[str, Any]:
    return {"seconds": history["seconds"],
            "evals": [{k: np.asarray(v, np.float64).tolist() for k, v in e.items()}
                      for e in history["evals"]]}


def _history_from_json(meta) -> dict[str, Any]:
    return {"seconds": float(meta["seconds"]),
            "evals": [{k: np.asarray(v, np.float32) for k, v in e.items()}
                      for e in meta["evals"]]}
