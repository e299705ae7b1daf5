"""The parts of a run, built once from its config: `RunParts`.

    parts = RunParts(config)                       # validated, nothing compiled yet
    state = parts.init_state()
    state, metrics = parts.step(state, parts.inputs(0, 64), parts.accum_steps(64))
    parts.evaluate(state)                          # {"loss": ..., "accuracy": ...}

`cbs.engine.trainer.Trainer` is the parts plus a run directory; sweep groups and branches
reuse the parts' model, data, step (`TrainStep.apply`) and evaluation sums.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from cbs import data, models
from cbs.data import batching
from cbs.engine import config as config_lib
from cbs.engine import lr, optim, schedules
from cbs.engine.measure import Measurement
from cbs.engine.state import TrainState, init_train_state
from cbs.engine.step import BatchLayout, StepOptions, TrainStep
from cbs.models import losses
from cbs.runtime import mesh as mesh_lib
from cbs.runtime.fields import ConfigError

__all__ = ["RunParts"]


class RunParts:
    """Mesh, dataset, batch schedule, model, optimizer direction, state shardings, the jitted
    step and the evaluations of a run, built once from `config` (validated first). mesh:
    default from `config.mesh`; dataset: one to use instead of `config.data` (tests, notebooks).
    """

    def __init__(self, config: ml_collections.ConfigDict, *,
                 mesh: jax.sharding.Mesh | None = None, dataset: data.Dataset | None = None):
        self.config = config
        try:
            self.mesh = mesh or mesh_lib.make_mesh(config.mesh.data, config.mesh.model)
        except ValueError as err:
            raise ConfigError(f"config.mesh: {err}") from err
        self.replicas = mesh_lib.data_replicas(self.mesh)
        self.noise_spec = config_lib.validate(  # config.noise, read once
            config, data_replicas=self.replicas, model_names=models.model_names(),
            dataset_names=None if dataset else data.known_datasets())
        try:
            self.dataset = dataset or data.get_dataset(config.data.name, **config.data.options)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"config.data: {err}") from err
        self.schedule = schedules.batch_schedule_from_config(
            config.batch.schedule, optimizer=str(config.optim.name))
        self._check_sizes()
        self._build_model()
        self._build_step()

    def _check_sizes(self) -> None:
        c, n = self.config, self.dataset.num_train
        if (c.eval.enabled and c.eval.full_train and not c.eval.train_examples
                and not self.dataset.in_memory("train")):
            raise ConfigError(
                f"config.eval.train_examples: the training split of {self.dataset.name} is "
                "streamed; evaluate a subset (eval.train_examples=n) or set eval.full_train="
                "False")
        largest = max(config_lib.batch_sizes(c))
        if largest > n:
            raise ConfigError(
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
            raise ConfigError(f"config.model: {err}") from err
        if jax.process_index() == 0:
            print(models.model_summary(abstract))
        self.graphdef, params, rest = models.split_model(abstract)
        self.stateful = losses.couples_examples(rest)
        if self.stateful and self.noise_spec.every:
            raise ConfigError(
                "config.noise.every: per-example statistics are ill-defined for a model with "
                "BatchNorm in training mode (set noise.every=0 or model.norm != 'batchnorm')")
        self.direction = optim.make_direction(c.optim)

        def make_state() -> TrainState:
            _, p, r = models.split_model(make_model())
            return init_train_state(p, self.direction, model_state=r,
                                    learning_rate=c.optim.learning_rate,
                                    ema_decay=self.noise_spec.ema_decay)

        self._make_state = make_state
        shapes = self.abstract_state()
        mode = c.mesh.get("param_mode", "replicated")
        shard = lambda tree: mesh_lib.param_shardings(tree, self.mesh, mode)
        # a TrainState of shardings (a pytree like the state): replicated but the parameters
        # and the optimizer state
        r = mesh_lib.replicated(self.mesh)
        self.state_sharding = jax.tree.map(lambda _: r, shapes).replace(
            params=shard(shapes.params), opt_state=shard(shapes.opt_state))

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
        batch_sh = mesh_lib.batch_sharding(self.mesh)
        if self.in_memory:
            rep = mesh_lib.replicated(self.mesh)
            self.train_arrays = ds.device_arrays("train", rep)

            def batch_fn(arrays, examples_seen, batch_size):
                batch = batching.device_batch(ds, arrays, examples_seen, batch_size, seed=c.seed)
                return jax.lax.with_sharding_constraint(batch, batch_sh)

            self.step = self.make_step(batch_fn, rep)
        else:
            self.loader = data.HostLoader(ds, seed=c.seed, sharding=batch_sh,
                                          batch_size_fn=self.schedule.planning_batch_size)
            self.step = self.make_step(None, batch_sh)
        self._evals: dict[tuple[str, int], Callable] = {}
        self._eval_parts: dict[tuple[str, int], tuple[Callable, Any]] = {}
        self.measurement = Measurement(self.noise_spec, self.step, seed=int(c.seed),
                                       parts=self, eval_steps=c.eval.get("steps", ()))

    def make_step(self, batch_fn: Callable[..., Any] | None, inputs_sharding: Any) -> TrainStep:
        """A `TrainStep` of this run's model, optimizer, mesh and config, with the inputs of
        `batch_fn` and `inputs_sharding` (`BatchLayout`; a branch's read a data-order seed)."""
        c, n = self.config, self.noise_spec
        rate = lr.step_rate(c, self.schedule.batch_size_at(0, self.schedule.init()))
        layout = BatchLayout(self.mesh, self.state_sharding, inputs_sharding,
                             micro_batch=c.batch.micro_batch, batch_fn=batch_fn)
        options = StepOptions(live=n.live, small_batch=n.small_batch,
                              grad_norm=c.train.get("grad_norm", True))
        return TrainStep(self.loss_fn, self.direction, rate, layout, options)

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
        return self.train_arrays if self.in_memory else self.loader(examples_seen, batch_size)

    def accum_steps(self, batch_size: int) -> int:
        """A = B / (R·m)."""
        return batch_size // (self.config.batch.micro_batch * self.replicas)

    # ------------------------------------------------------------------ evaluation

    def eval_sums_fn(self, split: str, num_examples: int = 0) -> tuple[Callable, Any]:
        """(fn, arrays): fn(params, model_state, arrays) -> {"loss_sum", "count"[,
        "correct_sum"]} over the first `num_examples` (0 = all) of `split`, in padded and
        masked chunks of `eval.batch_size` (a `lax.scan`; jittable, also under vmap)."""
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
            eval_fn = losses.make_eval_fn(self.graphdef, model_state, ds.task)

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
        return {f"{prefix}/{name}": float(s[key]) / float(s["count"])
                for prefix, s in sums.items()
                for name, key in (("loss", "loss_sum"), ("accuracy", "correct_sum")) if key in s}

    def evaluate(self, state: TrainState, split: str = "train", num_examples: int = 0
                 ) -> dict[str, float]:
        """Exact mean loss (and accuracy) over the first `num_examples` (0 = all) of a split,
        in fixed chunks on the device: `evaluate(state)` is the full training-set loss."""
        sums = jax.device_get(self._eval_fn(split, num_examples)(state))
        record = self.eval_record({"x": sums})
        return {k[2:]: v for k, v in record.items()}
