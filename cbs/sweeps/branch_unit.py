"""One unit of a branch study (a branch point and a multiplier k, with its S data-order seeds)
as a run of the engine's loop (`cbs.engine.loop.Loop`).

A branch starts from a reference checkpoint (step t_0, examples seen E) and trains Δ/(k·B)
steps at batch k·B and peak rate f(k)·η_0 (`branch_overrides`). Two drivers: `VmappedBranch`,
the S seeds as one state with a leading axis S, the whole window in one dispatch; and
`engine_branch`, one seed through `cbs.engine.trainer.Trainer` (streamed data too). A unit runs
in `workdir/units/` (`unit_dir`), removed once its records are written; one killed after its
last step resumes from the checkpoint the loop saved there.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from cbs.engine import schedules, spec, trainer
from cbs.engine.driver import Deferred, Restore
from cbs.engine.loop import Loop
from cbs.engine.parts import RunParts
from cbs.engine.state import TrainState, position
from cbs.results import files, records
from cbs.runtime import mesh, progress, throughput

__all__ = ["VmappedBranch", "branch_overrides", "engine_branch", "unit_dir"]


def unit_dir(workdir: str, step: int, k: int, seed: int | None = None) -> str:
    """The run directory of a unit (or of one seed's engine branch)."""
    name = f"p{step:09d}_k{k}" + ("" if seed is None else f"_s{seed}")
    return os.path.join(workdir, files.UNITS_DIR, name)


def branch_overrides(start: TrainState, *, batch_size: int, learning_rate: float,
                     num_steps: int, full_train: bool, seed: int | None = None,
                     evaluate: bool = True) -> spec.RunOverrides:
    """A branch of `num_steps` steps from `start`, data-order `seed` (None: the config's),
    evaluated at the end when `evaluate` (the full training-set loss too when `full_train`)."""
    end = position(start)[0] + num_steps
    return spec.RunOverrides(
        batch_size=batch_size, learning_rate=learning_rate, seed=seed, max_steps=end,
        max_examples=0, record_every=1, log_every=max(1, num_steps),
        checkpoint_every=max(1, end),  # none before the end (the loop saves one there)
        divergence_factor=0.0,  # only a non-finite loss stops a branch
        quiet=True, eval_enabled=evaluate, eval_every=0, full_train_eval=full_train)


class VmappedBranch:
    """A `cbs.engine.loop.Driver`: the S seeds of one branch as one vmapped state from `start`
    (`config`: `branch_overrides`'s run config; `parts`: the study's, on one device). `program`,
    `final_loss`: `cbs.sweeps.branches.BranchRunner`'s (`final_loss` None: NaN)."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, parts: RunParts,
                 start: TrainState, seeds: Sequence[int], program: Callable,
                 final_loss: Callable | None):
        self.config, self.workdir, self.parts = config, workdir, parts
        self.schedule = schedules.batch_schedule_from_config(
            config.batch.schedule, optimizer=str(config.optim.name))
        self.seeds = [int(s) for s in seeds]
        self.program, self.final_loss = program, final_loss
        self._rep = mesh.replicated(parts.mesh)
        self._start = start

    def _fresh(self) -> dict[str, Any]:
        s = len(self.seeds)
        lr = jnp.full((s,), float(self.config.optim.learning_rate), jnp.float32)
        states = jax.tree.map(lambda x: jnp.broadcast_to(x, (s, *x.shape)), self._start)
        nan = jnp.full((s,), jnp.nan, jnp.float32)  # no loss seen yet
        return jax.device_put({"trials": states.replace(learning_rate=lr), "loss_ema": nan,
                               "last_loss": nan}, self._rep)

    def start(self, restore: Restore | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The S seeds' states at the point (its step and examples seen), or restored."""
        if restore is not None:
            return restore(jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self._rep),
                jax.eval_shape(self._fresh)))
        step, seen = position(self._start)
        return self._fresh(), {"step": step, "examples_seen": seen}

    def advance(self, state: dict[str, Any], step: int, examples_seen: int, batch_size: int
                ) -> tuple[dict[str, Any], int, None]:
        """Every step left, in one dispatch."""
        del examples_seen, batch_size
        n = int(self.config.train.max_steps) - step
        states, ema, last = self.program(state["trials"], jnp.asarray(self.seeds, jnp.uint32),
                                         state["loss_ema"], jnp.asarray(n, jnp.int32))
        return {"trials": states, "loss_ema": ema, "last_loss": last}, n, None

    def evaluate_at(self, state: dict[str, Any], step: int) -> Deferred:
        """The end of the window: one record per seed."""
        nan = jnp.full((len(self.seeds),), jnp.nan, jnp.float32)
        final = self.final_loss(state["trials"]) if self.final_loss else nan
        values = {"loss_ema": state["loss_ema"], "train/loss": state["last_loss"],
                  "full_train/loss": final}
        return Deferred(values, lambda fetched: [
            {"seed": s} | {k: float(np.asarray(v)[i]) for k, v in fetched.items()}
            for i, s in enumerate(self.seeds)])

    def num_compilations(self) -> int:
        return self.program._cache_size()  # type: ignore[attr-defined]  # not in jax's stub

    def run(self) -> list[dict[str, float]]:
        """Trains (or resumes) the branch; per seed loss_ema, train/loss, full_train/loss."""
        perf = throughput.for_run(self.config, self.workdir, self.parts.dataset,
                                  self.parts.mesh)
        Loop(self, perf=perf, compilations=self.num_compilations).run()
        end = int(self.config.train.max_steps)
        by_seed = {r["seed"]: r for r in records.read_records(
            os.path.join(self.workdir, files.METRICS_FILE))
            if r.get("kind") == "eval" and r["step"] == end}
        keys = ("loss_ema", "train/loss", "full_train/loss")
        return [{k: _number(by_seed[s][k]) for k in keys} for s in self.seeds]


def engine_branch(config: ml_collections.ConfigDict, workdir: str, start: TrainState, *,
                  ema_decay: float, device_mesh: jax.sharding.Mesh, dataset: Any = None
                  ) -> tuple[float, float, float]:
    """One seed's branch through the engine's `Trainer` (`config`: `branch_overrides`'s):
    (loss EMA at the window's end, last batch loss, final full training-set loss or NaN)."""
    tr = trainer.Trainer(config, workdir, mesh=device_mesh, dataset=dataset, start=start)
    try:
        tr.run(raise_on_divergence=False)
    finally:
        tr.close()
    t0 = tr.start_position[0]
    recs = [r for r in records.read_records(os.path.join(workdir, files.METRICS_FILE))
            if r["step"] >= t0]
    losses = [_number(r["train/loss"]) for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"] if config.eval.full_train else []
    final = _number(evals[-1].get("full_train/loss")) if evals else math.nan
    return float(progress.ema_curve(losses, ema_decay)[-1]), losses[-1], final


def _number(value: Any) -> float:
    """A record's value as a float (null, a non-finite value in JSON, reads as NaN)."""
    return math.nan if value is None else float(value)
