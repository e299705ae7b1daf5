"""Training runs from a config: set-up, the loop, evaluation, checkpoints, records, resume.

    summary = cbs.train.run(config, workdir)              # train, or resume, to the end
    summary = cbs.train.run(config, workdir, stop_fn=fn)  # fn(step, record) -> True stops
    summary = cbs.train.run(config, workdir, on_eval=fn)  # fn(trainer, state, step) -> fields

`Trainer(config)` exposes the pieces (state, step, `evaluate`) for programs that drive
training themselves; the loop is `cbs.engine.loop.Loop` with the trainer as its driver.

The files of `workdir`, and resuming: docs/guides/training.md, "The run directory".
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from cbs import data
from cbs.engine import live_advice, measure, state
from cbs.engine.driver import Deferred, Restore
from cbs.engine.loop import DivergedError, Loop, StopFn, ended_run
from cbs.engine.noise_spec import NoiseSpec
from cbs.engine.parts import RunParts
from cbs.engine.state import TrainState
from cbs.results import files, paths, records
from cbs.runtime import checkpoint, throughput, writer

__all__ = ["CHECKPOINT_CHUNK", "EvalFn", "Trainer", "measure_checkpoint", "run"]

CHECKPOINT_CHUNK = 256  # examples per vmap chunk of `measure_checkpoint`'s exact pass

# on_eval(trainer, state, step) -> {record key: device scalar}: fields added to the eval record
# at the evaluation after `step` updates (dispatched with the evaluation, read with it).
EvalFn = Callable[["Trainer", TrainState, int], dict[str, Any]]


class Trainer(RunParts):
    """A run: its parts (`cbs.engine.parts.RunParts`) and its run directory `workdir` (None
    for in-memory use only); the driver of `cbs.engine.loop.Loop`.

    Args:
      on_eval: `EvalFn` whose fields join every eval record (None: the spec's measurement
        at evaluations, `cbs.engine.measure.Measurement.evaluation`, if any).
      start: a state to start from (a branch from a checkpoint of its reference run): the
        run starts at its step and examples seen, with the config's η_0; its budget counts
        from 0.
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | None = None, *,
                 mesh: jax.sharding.Mesh | None = None, dataset: data.Dataset | None = None,
                 on_eval: EvalFn | None = None, start: TrainState | None = None):
        super().__init__(config, mesh=mesh, dataset=dataset)
        if on_eval is None and self.noise_spec.measures_at_evals:
            on_eval = lambda tr, st, step: tr.measurement.evaluation(st, step)
        self.workdir, self.on_eval, self.start_state = workdir, on_eval, start
        self.outputs: writer.Outputs | None = None  # the bar and mirrors; None: the config's
        self.start_position = (0, 0) if start is None else state.position(start)
        self.advice = live_advice.LiveAdvice.from_config(  # the advice/* fields
            config, live_advice.calibration_file(self.noise_spec.advice_calibration))

    # ------------------------------------------------------------------ the loop's driver

    def start(self, restore: Restore | None) -> tuple[TrainState, dict[str, Any]]:
        """`Driver.start`, with the config's η_0 (`_restored`) on a `start` state too."""
        if restore is not None:
            restored, meta = restore(self._restore_target())
            return self._restored(restored), meta
        step, seen = self.start_position
        fresh = (self.init_state() if self.start_state is None else
                 self._restored(jax.device_put(self.start_state, self.state_sharding)))
        return fresh, {"step": step, "examples_seen": seen}

    def _restore_target(self) -> TrainState:
        """The state's abstract arrays with their shardings (what a checkpoint restores)."""
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            self.abstract_state(), self.state_sharding)

    def _restored(self, state: TrainState) -> TrainState:
        """The config's η_0 wins over the checkpoint's (a deliberate change on resume)."""
        base_lr = np.asarray(self.config.optim.learning_rate, np.float32)
        if float(state.learning_rate) == float(base_lr):
            return state
        return state.replace(learning_rate=jax.make_array_from_process_local_data(
            self.state_sharding.learning_rate, base_lr, ()))

    def advance(self, state: TrainState, step: int, examples_seen: int, batch_size: int
                ) -> tuple[TrainState, int, Deferred]:
        """Dispatches step `step` (`cbs.engine.measure.Measurement.step`: measuring when
        due): (state, 1, its record's fields to read later)."""
        a = self.accum_steps(batch_size)
        state, values = self.measurement.step(state, self.inputs(examples_seen, batch_size), a,
                                              step)
        head = {"data/batch_size": batch_size, "data/accum_steps": a}

        def fields(fetched: Any) -> list[dict[str, Any]]:
            rec = head | self.measurement.fields(step, fetched)
            return [rec | self.advice.record(rec)]

        return state, 1, Deferred(values, fields)

    def evaluate_at(self, state: TrainState, step: int) -> Deferred:
        """Dispatches the configured evaluations and the `on_eval` fields."""
        out = {"sums": self.evaluate_async(state)}
        if self.on_eval is not None:
            out["extra"] = self.on_eval(self, state, step)

        def fields(fetched: dict[str, Any]) -> list[dict[str, Any]]:
            extra = {k: float(v) for k, v in fetched.get("extra", {}).items()}
            return [self.eval_record(fetched["sums"]) | extra]

        return Deferred(out, fields)

    # ------------------------------------------------------------------ the run

    def run(self, *, stop_fn: StopFn | None = None, raise_on_divergence: bool = True
            ) -> dict[str, Any]:
        """Trains from the latest checkpoint in `workdir` (or from scratch) to the end; the
        summary written to status.json (`run`)."""
        if self.workdir is None:
            raise ValueError("Trainer.run needs a workdir")
        perf = throughput.for_run(self.config, self.workdir, self.dataset, self.mesh)
        loop = Loop(self, stop_fn, outputs=self.outputs, perf=perf,
                    compilations=self.measurement.num_compilations)
        return loop.run(raise_on_divergence)


def run(config: ml_collections.ConfigDict, workdir: str, *, stop_fn: StopFn | None = None,
        raise_on_divergence: bool = True, mesh: jax.sharding.Mesh | None = None,
        on_eval: EvalFn | None = None, outputs: writer.Outputs | None = None
        ) -> dict[str, Any]:
    """Trains (or resumes, or returns the summary of an ended run) in `workdir`; returns the
    summary written to status.json.

    stop_fn(step, record) -> bool is called on every record written (in step order, up to
    `log_every` steps late); True ends the run as "stopped" after a final evaluation and
    checkpoint. raise_on_divergence: raise `DivergedError` when the run diverges (after
    recording it), else return the summary with status "diverged". on_eval: `EvalFn`, not
    part of the config's hash. outputs: the bar and mirrors (`cbs.runtime.writer.Outputs`;
    default: the config's).
    """
    created = not paths.exists(workdir)
    paths.makedirs(workdir)
    status = ended_run(workdir, config, raise_on_divergence=raise_on_divergence)
    if status is not None:
        return status
    fresh = not _has_checkpoint(workdir)
    try:
        trainer = Trainer(config, workdir, mesh=mesh, on_eval=on_eval)
        trainer.outputs = outputs  # None: the config's
        try:
            return trainer.run(stop_fn=stop_fn, raise_on_divergence=raise_on_divergence)
        finally:
            trainer.close()
    except DivergedError:
        raise
    except BaseException:
        # nothing to resume: process 0 removes what the run wrote (the workdir too if this run
        # created it), so the corrected command starts clean
        if fresh and not _has_checkpoint(workdir) and jax.process_index() == 0:
            for name in _RUN_FILES:
                paths.remove(os.path.join(workdir, name))
            for name in _RUN_DIRS:
                if paths.isdir(os.path.join(workdir, name)):
                    paths.rmtree(os.path.join(workdir, name))
            if created:
                paths.rmdir(workdir)
        raise


_RUN_FILES = (files.CONFIG_FILE, files.STATUS_FILE, files.METRICS_FILE, files.WANDB_RUN_FILE)
_RUN_DIRS = (checkpoint.CHECKPOINT_DIR, writer.TENSORBOARD_DIR, "profile")


def _has_checkpoint(workdir: str) -> bool:
    return bool(paths.listdir(os.path.join(workdir, checkpoint.CHECKPOINT_DIR)))


def measure_checkpoint(workdir: str, step: int | None = None, *, examples: int = 0,
                       curvature: bool = False, deviations: int = 256,
                       mesh: jax.sharding.Mesh | None = None) -> dict[str, Any]:
    """The noise scale exactly at checkpoint `step` (None: the latest) of the run in
    `workdir` (its config.json), by `cbs.engine.measure.measure` on all N training examples
    (`examples` = 0 or ≥ N: "full_data", exact; the split must be in memory) or on `examples`
    = n < N of the measurement stream (index 0 of `cbs.engine.measure.draw`, seed
    `config.seed`). `curvature`: also B_noise, from `deviations` examples' deviations.

    Returns {"step", "examples_seen", "batch_size" (the schedule's B at that state),
    "optimizer", "task" ("data/model"), "learning_rate" (η_0), "num_train", "examples"
    (measured), "method", "full_train/loss" (at the state, `config.eval.train_examples`),
    "noise/<key>" (`cbs.engine.measure.EVAL_KEYS`)}.
    """
    raw = records.read_json(os.path.join(workdir, files.CONFIG_FILE))
    if raw is None:
        raise FileNotFoundError(f"{workdir} has no {files.CONFIG_FILE}: give the run directory "
                                "of `cbs-train --workdir=...`")
    directory = os.path.join(workdir, checkpoint.CHECKPOINT_DIR)
    if not paths.isdir(directory):
        raise FileNotFoundError(f"{workdir} has no {checkpoint.CHECKPOINT_DIR}/ (set "
                                "config.train.checkpoint_every > 0)")
    config = ml_collections.ConfigDict(raw)
    tr = Trainer(config, mesh=mesh)
    try:
        n = tr.dataset.num_train
        every = not examples or examples >= n
        if every and not tr.in_memory:
            raise ValueError(f"the training split of {tr.dataset.name} is streamed: measure a "
                             "stated number of examples (examples=n)")
        n_stream = 0 if every else examples
        spec = NoiseSpec(examples="all" if every else "stream", batch_size=n_stream,
                         hessian_batch_size=n_stream, curvature=curvature,
                         deviations=deviations, chunk_size=CHECKPOINT_CHUNK)
        ckpt = checkpoint.Checkpointer(directory, max_to_keep=None)
        try:
            state, meta = ckpt.restore(step, tr._restore_target())
        finally:
            ckpt.close()
        seed = int(config.seed)
        if tr.in_memory:
            stats = jax.jit(measure.state_measurement(spec, tr, seed=seed))(state, jnp.int32(0))
        else:
            grad_batch, hess_batch = measure.host_draw(spec, tr.dataset, 0, seed=seed)
            loss = lambda p, b: tr.loss_fn(p, state.model_state, b)[0]
            stats = measure.evaluation_record(jax.jit(
                lambda p, g, h: measure.measure(spec, loss, p, g, hessian_batch=h))(
                    state.params, grad_batch, hess_batch))
        schedule_state = tr.schedule.state_from_dict(meta.get("schedule_state"))
        loss_at = tr.evaluate(state, "train", int(config.eval.train_examples))["loss"]
        return {"step": int(meta["step"]), "examples_seen": int(meta["examples_seen"]),
                "batch_size": tr.schedule.batch_size_at(int(meta["examples_seen"]),
                                                        schedule_state),
                "optimizer": str(config.optim.name), "num_train": n,
                "task": f"{config.data.name}/{config.model.name}",
                "learning_rate": float(config.optim.learning_rate),
                "examples": n if every else min(examples, n),
                "method": spec.resolved_method(), "full_train/loss": loss_at,
                **{f"noise/{k}": float(v) for k, v in jax.device_get(stats).items()}}
    finally:
        tr.close()
