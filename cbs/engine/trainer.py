"""Training runs from a config: set-up, the loop, evaluation, checkpoints, records, resume.

    summary = cbs.train.run(config, workdir)              # train, or resume, to the end
    summary = cbs.train.run(config, workdir, stop_fn=fn)  # fn(step, record) -> True stops
    summary = cbs.train.run(config, workdir, on_eval=fn)  # fn(trainer, state, step) -> fields

`Trainer(config)` exposes the pieces (state, step, `evaluate`) for programs that drive
training themselves. The jitted step is `cbs.engine.step.TrainStep`; the config is
`cbs.engine.config.default_config()`.

Loop (`cbs.engine.loop.Loop`, with the trainer as its driver), at step t with E examples
seen (host ints; the state on the device holds the same): evaluate if due (the parameters
after t updates); save a checkpoint if due (after reading every pending metric, so a saved
state never follows a non-finite loss); stop if the budget is spent or `stop_fn` asked; feed
the schedule the smoothed noise scale it observes (`schedule.observes`, every
`batch.adapt_every` steps); B from the schedule; dispatch step t; every `log_every` steps read
the metrics of all steps but the newest (so the device is never idle waiting for the host).

Files in `workdir` (process 0 writes records; every process writes its checkpoint shards):
- `config.json`: the config of the latest start.
- `metrics.jsonl`: records (see `cbs.results.records`). Train records: step, kind="train",
  data/examples_seen (before the step), data/batch_size, data/accum_steps, train/loss,
  opt/lr, opt/grad_norm, noise/live_{grad_sq_norm,trace_sigma} (the live estimate) and
  noise/live_exact (1: exact from per-example norms, 0: two-batch; `cbs.engine.live_noise`),
  noise/ema_{b_simple,grad_sq_norm,trace_sigma} and, on measured steps, noise/{b_simple,
  grad_sq_norm, trace_sigma, mean_grad_sq_norm[, b_noise, g_h_g, trace_h_sigma, mean_g_h_g]},
  noise/measured_ema_*, noise/batch_size. Eval records: step, kind="eval",
  data/examples_seen, eval/loss, eval/accuracy, full_train/loss, full_train/accuracy, and
  the fields of `on_eval` when given (a sweep's noise measurement, `cbs.sweeps.measurement`).
- `status.json`: status ("running" | "preempted" | "finished" | "stopped" | "diverged"), step,
  examples_seen, checkpoint_step, message, config_hash, last train and eval records.
- `checkpoints/`: orbax (`cbs.engine.checkpoint`), `tensorboard/`: event files (when on).
SIGTERM after `cbs.engine.preemption.install()` (the entry points call it) saves a checkpoint at
the current step and raises `Preempted` with status "preempted".
A restart with the same command resumes from the latest checkpoint and first drops records
at or after its step, so the records equal an uninterrupted run's. A run whose status.json
says it ended, with the same config, is not run again: its summary is returned.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from cbs import data, models
from cbs.engine import checkpoint, lr, optim, schedules
from cbs.engine import config as config_lib
from cbs.engine import mesh as mesh_lib
from cbs.engine.loop import ENDED, DivergedError, Loop, StopFn, config_hash
from cbs.engine.step import Measurement, TrainState, TrainStep, init_train_state
from cbs.results import files, paths, records

__all__ = ["DivergedError", "EvalFn", "Trainer", "config_hash", "run"]

# on_eval(trainer, state, step) -> {record key: device scalar}: fields added to the eval record
# at the evaluation after `step` updates (dispatched with the evaluation, read with it).
EvalFn = Callable[["Trainer", TrainState, int], dict[str, Any]]
_ON_EVAL = "on_eval"  # the key of the hook's values among an evaluation's device values

class Trainer:
    """Everything a run needs, built from `config` (validated before any compilation).

    Args:
      config: a `cbs.engine.config.default_config()`-shaped ConfigDict.
      workdir: run directory (records, checkpoints); None for in-memory use only.
      mesh: device mesh (default `cbs.engine.mesh.make_mesh(config.mesh.data, config.mesh.model)`).
      dataset: a `cbs.data.Dataset` to use instead of `config.data` (tests, notebooks).
      on_eval: `EvalFn` whose fields join every eval record (None: none).
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | None = None, *,
                 mesh: jax.sharding.Mesh | None = None, dataset: data.Dataset | None = None,
                 on_eval: EvalFn | None = None):
        self.config, self.workdir, self.on_eval = config, workdir, on_eval
        try:
            self.mesh = mesh or mesh_lib.make_mesh(config.mesh.data, config.mesh.model)
        except ValueError as err:
            raise config_lib.ConfigError(f"config.mesh: {err}") from err
        self.replicas = mesh_lib.data_replicas(self.mesh)
        config_lib.validate(config, data_replicas=self.replicas, model_names=models.model_names(),
                            dataset_names=None if dataset else data.known_datasets())
        self.dataset = dataset or self._load_dataset()
        self.schedule = schedules.batch_schedule_from_config(config.batch.schedule)
        self._check_sizes()
        self._build_model()
        self._build_step()

    # ------------------------------------------------------------------ set-up

    def _load_dataset(self) -> data.Dataset:
        try:
            return data.get_dataset(self.config.data.name, **self.config.data.options)
        except (ValueError, TypeError) as err:
            raise config_lib.ConfigError(f"config.data: {err}") from err

    def _check_sizes(self) -> None:
        c, n = self.config, self.dataset.num_train
        if (c.eval.enabled and c.eval.full_train and not c.eval.train_examples
                and not self.dataset.in_memory("train")):
            raise config_lib.ConfigError(
                f"config.eval.train_examples: the training split of {self.dataset.name} is "
                "streamed; evaluate a subset (eval.train_examples=n) or set eval.full_train="
                "False")
        largest = max(config_lib.batch_sizes(c))
        if largest > n:
            raise config_lib.ConfigError(
                f"config.batch.schedule: batch size {largest} exceeds the {n} training "
                f"examples of {self.dataset.name}")

    def _build_model(self) -> None:
        c, ds = self.config, self.dataset

        def make_model():
            return models.build_model(c.model, input_shape=ds.input_shape,
                                      num_classes=ds.num_classes if ds.task != "regression"
                                      else None, vocab_size=ds.vocab_size,
                                      rngs=nnx.Rngs(c.seed), verbose=False)

        try:
            abstract = nnx.eval_shape(make_model)
        except ValueError as err:
            raise config_lib.ConfigError(f"config.model: {err}") from err
        if jax.process_index() == 0:
            print(models.model_summary(abstract))
        self.graphdef, params, rest = models.split_model(abstract)
        self.stateful = models.couples_examples(rest)
        if self.stateful and c.noise.every:
            raise config_lib.ConfigError(
                "config.noise.every: per-example statistics are ill-defined for a model with "
                "BatchNorm in training mode (set noise.every=0 or model.norm != 'batchnorm')")
        self.direction = optim.make_direction(c.optim)

        def make_state() -> TrainState:
            _, p, r = models.split_model(make_model())
            return init_train_state(p, self.direction, model_state=r,
                                    learning_rate=c.optim.learning_rate,
                                    ema_decay=c.noise.ema_decay)

        self._make_state = make_state
        shapes = self.abstract_state()
        mode = c.mesh.get("param_mode", "replicated")
        shard = lambda tree: mesh_lib.param_shardings(tree, self.mesh, mode)
        rep = lambda tree: jax.tree.map(lambda _: mesh_lib.replicated(self.mesh), tree)
        self.state_sharding = TrainState(
            # a TrainState of shardings (a pytree like the state); its fields are typed as arrays
            step=mesh_lib.replicated(self.mesh),  # type: ignore[arg-type]
            examples_seen=mesh_lib.replicated(self.mesh),  # type: ignore[arg-type]
            learning_rate=mesh_lib.replicated(self.mesh),  # type: ignore[arg-type]
            params=shard(shapes.params), opt_state=shard(shapes.opt_state),
            model_state=rep(shapes.model_state), noise_ema=rep(shapes.noise_ema),
            measure_ema=rep(shapes.measure_ema))

    def loss_fn(self, params, model_state, batch):
        """Stateful training loss: (mean loss, new model state)."""
        if self.stateful:
            return models.make_loss_fn(self.graphdef, model_state, self.dataset.task,
                                       return_state=True)(params, batch)
        fn = models.make_loss_fn(self.graphdef, model_state, self.dataset.task)
        return fn(params, batch), model_state

    def _build_step(self) -> None:
        c, ds = self.config, self.dataset
        self.in_memory = ds.in_memory("train")
        rep = mesh_lib.replicated(self.mesh)
        batch_fn: Callable[..., Any] | None
        if self.in_memory:
            self.train_arrays = ds.device_arrays("train", rep)
            batch_sh = mesh_lib.batch_sharding(self.mesh)

            def batch_fn(arrays, examples_seen, batch_size):
                batch = data.device_batch(ds, arrays, examples_seen, batch_size, seed=c.seed)
                return jax.lax.with_sharding_constraint(batch, batch_sh)

            inputs_sharding = rep
        else:
            self.loader = data.HostLoader(ds, seed=c.seed,
                                          sharding=mesh_lib.batch_sharding(self.mesh),
                                          batch_size_fn=self._static_batch_size)
            batch_fn, inputs_sharding = None, mesh_lib.batch_sharding(self.mesh)
        n = c.noise
        measure = None
        if n.every:
            n_micro = max(1, n.batch_size // (c.batch.micro_batch * self.replicas))
            measure = Measurement(n.method, n.every, n_micro, n.curvature, n.num_probes,
                                  n.chunk_size, n.in_step)
        coupling = lr.coupling_from_config(
            c.batch.lr_coupling, self.schedule.batch_size_at(0, self.schedule.init()))
        self.step = TrainStep(self.loss_fn, self.direction, lr.learning_rate_shape(c),
                              self.mesh, self.state_sharding, inputs_sharding,
                              micro_batch=c.batch.micro_batch, small_batch=n.small_batch,
                              live=n.get("live", "auto"), two_batch=n.two_batch,
                              batch_fn=batch_fn, lr_coupling=coupling, measure=measure,
                              seed=c.seed)
        self._evals: dict[tuple[str, int], Callable] = {}
        self._eval_parts: dict[tuple[str, int], tuple[Callable, Any]] = {}

    def _static_batch_size(self, examples_seen: int) -> int:
        return self.schedule.planning_batch_size(examples_seen)

    def close(self) -> None:
        """Stops the host prefetch threads of a streamed dataset (no-op in memory)."""
        if not self.in_memory:
            self.loader.close()

    def abstract_state(self) -> TrainState:
        """The state's shapes and dtypes (jax.ShapeDtypeStruct leaves), nothing computed."""
        return jax.eval_shape(self._make_state)

    def init_state(self) -> TrainState:
        """A fresh state on the mesh (parameters from `config.seed`)."""
        return jax.jit(self._make_state, out_shardings=self.state_sharding)()

    def inputs(self, examples_seen: int, batch_size: int) -> Any:
        """The step's second argument at stream position E for batch size B."""
        if self.in_memory:
            return self.train_arrays
        return self.loader(examples_seen, batch_size)

    def accum_steps(self, batch_size: int) -> int:
        """A = B / (R·m)."""
        return batch_size // (self.config.batch.micro_batch * self.replicas)

    # ------------------------------------------------------------------ evaluation

    def eval_sums_fn(self, split: str, num_examples: int = 0) -> tuple[Callable, Any]:
        """(fn, arrays): fn(params, model_state, arrays) -> {"loss_sum", "count"[,
        "correct_sum"]} over the first `num_examples` (0 = all) of `split`, in fixed chunks of
        `eval.batch_size` on the device (a `lax.scan`, padded and masked). Pure and jittable
        (also under vmap); `arrays` are the split's device-resident arrays."""
        key = (split, num_examples)
        if key in self._eval_parts:
            return self._eval_parts[key]
        ds, c = self.dataset, self.config
        s = ds.split(split)
        n = min(num_examples or s.num_examples, s.num_examples)
        chunk = -(-min(c.eval.batch_size, n) // self.replicas) * self.replicas
        rep, batch_sh = mesh_lib.replicated(self.mesh), mesh_lib.batch_sharding(self.mesh)
        if s.in_memory:
            arrays, view = ds.device_arrays(split, rep), cast(Callable, s.view)  # in memory
        else:  # a streamed split: its first n examples, read once and kept on the device
            host = s.read(np.arange(n))
            arrays = {k: jax.make_array_from_process_local_data(rep, v, v.shape)
                      for k, v in host.items()}
            view = lambda a, idx: {k: v[idx] for k, v in a.items()}

        def sums_fn(params, model_state, arrays):
            eval_fn = models.make_eval_fn(self.graphdef, model_state, ds.task)

            def chunk_sums(start):
                idx = start + jnp.arange(chunk, dtype=jnp.int32)
                real = idx < n
                idx = jax.lax.with_sharding_constraint(jnp.minimum(idx, n - 1), batch_sh)
                return eval_fn(params, view(arrays, idx) | {"mask": real.astype(jnp.float32)})

            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                                 jax.eval_shape(chunk_sums, jnp.int32(0)))
            body = lambda sums, start: (jax.tree.map(jnp.add, sums, chunk_sums(start)), None)
            return jax.lax.scan(body, zeros, jnp.arange(0, n, chunk, dtype=jnp.int32))[0]

        self._eval_parts[key] = sums_fn, arrays
        return sums_fn, arrays

    def _eval_fn(self, split: str, num_examples: int) -> Callable:
        """state -> device sums, jitted once per (split, num_examples)."""
        key = (split, num_examples)
        if key not in self._evals:
            sums_fn, arrays = self.eval_sums_fn(split, num_examples)
            jitted = jax.jit(sums_fn, out_shardings=mesh_lib.replicated(self.mesh))
            self._evals[key] = lambda state: jitted(state.params, state.model_state, arrays)
        return self._evals[key]

    def evaluate_async(self, state: TrainState) -> dict[str, Any]:
        """Dispatches the configured evaluations; returns device sums (see `eval_record`)."""
        e = self.config.eval
        out = {"eval": self._eval_fn("eval", e.num_examples)(state)}
        if e.full_train:
            out["full_train"] = self._eval_fn("train", e.train_examples)(state)
        return out

    @staticmethod
    def eval_record(sums: dict[str, Any]) -> dict[str, float]:
        """{"eval/loss", "eval/accuracy", "full_train/loss", ...} from fetched sums."""
        out = {}
        for prefix, s in sums.items():
            count = float(s["count"])
            out[f"{prefix}/loss"] = float(s["loss_sum"]) / count
            if "correct_sum" in s:
                out[f"{prefix}/accuracy"] = float(s["correct_sum"]) / count
        return out

    def evaluate(self, state: TrainState, split: str = "train", num_examples: int = 0
                 ) -> dict[str, float]:
        """Exact mean loss (and accuracy) over the first `num_examples` (0 = all) of a split,
        in fixed chunks on the device: `evaluate(state)` is the full training-set loss."""
        sums = jax.device_get(self._eval_fn(split, num_examples)(state))
        record = self.eval_record({"x": sums})
        return {k[2:]: v for k, v in record.items()}

    # ------------------------------------------------------------------ the loop's driver

    read_each_evaluation = False  # metrics are read every `train.log_every` steps

    def restore_target(self) -> TrainState:
        """The state's abstract arrays with their shardings (what a checkpoint restores)."""
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            self.abstract_state(), self.state_sharding)

    def restored(self, state: TrainState) -> TrainState:
        """The config's η_0 wins over the checkpoint's (a deliberate change on resume)."""
        base_lr = np.asarray(self.config.optim.learning_rate, np.float32)
        if float(state.learning_rate) == float(base_lr):
            return state
        return state.replace(learning_rate=jax.make_array_from_process_local_data(
            self.state_sharding.learning_rate, base_lr, ()))

    def advance(self, state: TrainState, step: int, examples_seen: int, batch_size: int
                ) -> tuple[TrainState, int, Any]:
        """Dispatches step `step` (and, when due and not in the step, the noise measurement
        before it): (state, 1, (step metrics, measured metrics or None))."""
        n = self.config.noise
        a = self.accum_steps(batch_size)
        inputs = self.inputs(examples_seen, batch_size)
        measured = None
        if n.every and step % n.every == 0 and not self.step.measured_in_step(state, inputs, a):
            state, measured = self.step.measure_now(state, inputs, a)
        state, step_metrics = self.step(state, inputs, a)
        return state, 1, (step_metrics, measured)

    def checkpoint_due(self, step: int) -> bool:
        return step % self.config.train.checkpoint_every == 0

    def evaluation_due(self, step: int) -> bool:
        every = self.config.eval.every
        return bool(every and step % every == 0)

    def evaluate_at(self, state: TrainState, step: int) -> dict[str, Any]:
        out = self.evaluate_async(state)
        if self.on_eval is not None:
            out[_ON_EVAL] = self.on_eval(self, state, step)
        return out

    def eval_records(self, sums: dict[str, Any]) -> list[dict[str, float]]:
        sums = dict(sums)
        extra = {k: float(v) for k, v in sums.pop(_ON_EVAL, {}).items()}
        return [self.eval_record(sums) | extra]

    def noise_scale(self, state: TrainState, name: str) -> float:
        """The smoothed noise scale `name`: B_simple from the in-step two-batch EMA, B_noise
        from the EMA of the periodic measurements (the only one with curvature)."""
        ema = state.measure_ema if name == "b_noise" else state.noise_ema
        return float(jax.device_get(getattr(ema, name)))

    def num_compilations(self) -> int:
        return self.step.num_compilations()

    # ------------------------------------------------------------------ the run

    def run(self, *, stop_fn: StopFn | None = None, raise_on_divergence: bool = True
            ) -> dict[str, Any]:
        """Trains from the latest checkpoint in `workdir` (or from scratch) to the end.

        Returns the summary written to status.json. Raises DivergedError on a non-finite
        loss (after recording it) unless raise_on_divergence=False.
        """
        if self.workdir is None:
            raise ValueError("Trainer.run needs a workdir")
        return Loop(self, stop_fn).run(raise_on_divergence)


def run(config: ml_collections.ConfigDict, workdir: str, *, stop_fn: StopFn | None = None,
        raise_on_divergence: bool = True, mesh: jax.sharding.Mesh | None = None,
        on_eval: EvalFn | None = None) -> dict[str, Any]:
    """Trains (or resumes, or returns the summary of an ended run) in `workdir`.

    Args:
      config: see `cbs.engine.config.default_config()`; validated before anything compiles.
      workdir: the run directory (see the module docstring for its files).
      stop_fn: stop_fn(step, record) -> bool, called on every record written (train and
        eval, in step order, up to `log_every` steps late); True ends the run as "stopped"
        after a final evaluation and checkpoint.
      raise_on_divergence: raise DivergedError on a non-finite loss (else return the summary
        with status "diverged").
      mesh: device mesh (default from config.mesh).
      on_eval: on_eval(trainer, state, step) -> {record key: device scalar}, fields added to
        every eval record (`EvalFn`); not part of the config, so not of its hash.
    """
    created = not paths.exists(workdir)
    paths.makedirs(workdir)
    status = records.read_json(os.path.join(workdir, files.STATUS_FILE))
    if status and status.get("status") in ENDED and status.get("config_hash") == config_hash(
            config):
        if status["status"] == "diverged" and raise_on_divergence:
            raise DivergedError(status.get("message", "diverged"), status)
        return status
    fresh = not _has_checkpoint(workdir)
    try:
        trainer = Trainer(config, workdir, mesh=mesh, on_eval=on_eval)
        try:
            return trainer.run(stop_fn=stop_fn, raise_on_divergence=raise_on_divergence)
        finally:
            trainer.close()
    except DivergedError:
        raise
    except BaseException:
        if fresh and not _has_checkpoint(workdir):  # nothing to resume: leave no half-made run
            _remove_run_files(workdir, created)
        raise


_RUN_FILES = (files.CONFIG_FILE, files.STATUS_FILE, files.METRICS_FILE)
_RUN_DIRS = (checkpoint.CHECKPOINT_DIR, "tensorboard", "profile")


def _has_checkpoint(workdir: str) -> bool:
    ckpts = os.path.join(workdir, checkpoint.CHECKPOINT_DIR)
    return paths.isdir(ckpts) and any(paths.epath(ckpts).iterdir())


def _remove_run_files(workdir: str, created: bool) -> None:
    """Removes what a run that failed before its first checkpoint wrote (process 0), so the
    corrected command starts clean; the workdir itself too if this run created it."""
    if jax.process_index() != 0:
        return
    for name in _RUN_FILES:
        path = paths.epath(os.path.join(workdir, name))
        if path.exists():
            path.unlink()
    for name in _RUN_DIRS:
        if paths.isdir(os.path.join(workdir, name)):
            paths.rmtree(os.path.join(workdir, name))
    if created and paths.isdir(workdir) and not any(paths.epath(workdir).iterdir()):
        paths.epath(workdir).rmdir()
