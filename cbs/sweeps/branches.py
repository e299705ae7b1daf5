"""Local critical batch size by branched training (Merrill, Arora, Groeneveld, Hajishirzi 2025,
"Critical Batch Size Revisited", arXiv 2505.23971, Sec. 3; the protocol and its defaults:
docs/guides/local_cbs.md).

Letters: B the reference run's batch, η_0 its peak learning rate, E examples seen at a branch
point, k a batch multiplier from the ladder K, Δ the window in examples, S the branch seeds.

A reference run at (B, η_0) (an engine run on one device in `workdir/reference`, every
checkpoint kept) gives the branch points (`branch.points_examples`, `branch.points_losses`).
From each point and each k, a branch trains Δ examples at batch k·B and peak rate f(k)·η_0;
each (point, k) is a unit of S data-order seeds (`cbs.sweeps.branch_unit`), and the k of one
seed read the same stream positions [E, E + Δ) (common random numbers). k* and B*:
`cbs.analysis.reports.branch_report`.

Files in `workdir`: `branch.json` (definition), `reference/`, `branches.d/` (a write-once part
per (point, k), one record per seed), `branches.jsonl` (their export; read with
`shared.read_merged(path, UNIT_KEYS)`), `reference_noise.jsonl` (`cbs.sweeps.branch_noise`) and
`units/` while a unit runs. A killed run resumes to an uninterrupted run's records (finished
units skipped). `shard="i/n"` runs the units whose index is ≡ i (mod n).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections

from cbs import data, models
from cbs.data import batching
from cbs.engine import config as config_lib
from cbs.engine import loop, spec, trainer
from cbs.engine.parts import RunParts
from cbs.engine.state import TrainState, position
from cbs.engine.step import TrainStep
from cbs.engine.vmapped import vmapped_steps
from cbs.results import files, paths, records, shared
from cbs.results.store import OUTPUT_FIELDS, definition_diff, describe
from cbs.runtime import checkpoint, mesh, preemption, progress
from cbs.runtime.writer import CountBar
from cbs.sweeps import branch_config, branch_noise, branch_unit
from cbs.sweeps.grid import parse_shard

__all__ = [
    "UNIT_KEYS", "BranchRunner", "pending_units", "run_branches", "run_reference",
    "write_definition",
]

UNIT_KEYS = ("point_step", "k", "seed")  # what identifies a branch record

def branch_steps(config: ml_collections.ConfigDict, ckpt_steps: Sequence[int],
                 reference: Sequence[dict[str, Any]]) -> list[int]:
    """The checkpoint steps to branch from (`branch.points_*`), sorted."""
    b, bsz = config.branch, branch_config.reference_batch(config)
    ckpts = sorted(s for s in ckpt_steps if s > 0)
    train_recs = sorted((r for r in reference if r.get("kind") == "train"),
                        key=lambda r: r["step"])
    ema = progress.ema_curve([r["train/loss"] for r in train_recs], float(b.loss_ema_decay))
    hits = ([r["step"] + 1 for r, v in zip(train_recs, ema, strict=True) if v <= target]
            for target in b.points_losses)  # the steps whose smoothed loss is at or below
    limits = [int(e) // bsz for e in b.points_examples] + [hit[0] for hit in hits if hit]
    return sorted({max(s for s in ckpts if s <= limit) for limit in limits
                   if ckpts and ckpts[0] <= limit})


class BranchRunner:
    """Runs the branches of one study; `run_unit(step, k)` returns a unit's records.
    `checkpoints`: those to branch from (default: the reference run's); `lr_scale`: η_0 of
    branch k is f(k)·lr_scale·η, η the state's peak rate."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, *,
                 dataset: data.Dataset | None = None, checkpoints: str | None = None,
                 lr_scale: float = 1.0):
        branch_config.validate_branch_config(config)
        self.config, self.workdir, self.b, self.dataset = config, workdir, config.branch, dataset
        self.bsz = branch_config.reference_batch(config)
        self.branch_config = c = spec.run_config(config, spec.RunOverrides(
            noise_every=0,  # no per-example measurements inside branches
            schedule=dict(config.batch.schedule.to_dict(),
                          batch_size=int(self.b.ks[-1]) * self.bsz),  # checked up to max k
            eval_enabled=False), drop=())
        one = mesh.make_mesh(data=1, model=1, devices=jax.devices()[:1])
        self.mesh, self.rep = one, mesh.replicated(one)
        self.parts = RunParts(c, mesh=one, dataset=dataset)
        self.vmap = bool(self.b.vmap) and self.parts.in_memory
        self.lr_scale = float(lr_scale)
        self.ckpt = checkpoint.Checkpointer(checkpoints or os.path.join(
            workdir, files.REFERENCE_DIR, checkpoint.CHECKPOINT_DIR), max_to_keep=None)
        self._programs: dict[int, Callable] = {}
        self._final: Callable | None = None
        if self.vmap:
            self.step, self._final = self._seeded_step(), self._final_loss_fn()

    def close(self) -> None:
        self.ckpt.close()
        self.parts.close()

    def _seeded_step(self) -> TrainStep:
        """The engine's step with the data-order seed an input (so seeds can be vmapped)."""
        ds = self.parts.dataset

        def batch_fn(inputs, examples_seen, batch_size):
            return batching.device_batch(ds, inputs["arrays"], examples_seen, batch_size,
                                     seed=inputs["seed"])

        return self.parts.make_step(batch_fn, self.rep)

    def restore(self, step: int) -> TrainState:
        """The reference state after `step` updates, on this runner's device."""
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.rep),
                              self.parts.abstract_state())
        return self.ckpt.restore(step, target)[0]

    def _final_loss_fn(self) -> Callable | None:
        """jit of states[S] -> the full training-set loss of each, or None (not measured)."""
        if self.b.metric != "full_train/loss":
            return None
        fn, arrays = self.parts.eval_sums_fn("train", self.config.eval.train_examples)

        def loss(state):
            sums = fn(state.params, state.model_state, arrays)
            return sums["loss_sum"] / sums["count"]

        return jax.jit(jax.vmap(loss))

    def _program(self, k: int) -> Callable:
        """jit(vmap over seeds) of branch k: (states[S], seeds[S], loss_ema[S], n) ->
        (states, loss_ema, last_loss) after n steps (n traced: one compilation per k)."""
        if k in self._programs:
            return self._programs[k]
        steps = vmapped_steps(self.step.apply, self.parts.accum_steps(k * self.bsz),
                              branch_config.ema_decay_per_step(self.config, k),
                              inputs_axes={"arrays": None, "seed": 0})  # a stream per seed
        arrays = self.parts.train_arrays

        def program(states, seeds, ema, n):
            return steps(states, {"arrays": arrays, "seed": seeds}, ema, n)

        self._programs[k] = jax.jit(program)
        return self._programs[k]

    def _overrides(self, state: TrainState, k: int, seed: int | None = None,
                   evaluate: bool = True) -> spec.RunOverrides:
        window = branch_config.window_examples(self.config, position(state)[1])
        lr0 = float(jax.device_get(state.learning_rate)) * self.lr_scale
        return branch_unit.branch_overrides(
            state, batch_size=k * self.bsz,
            learning_rate=branch_config.lr_factor(k, self.b.lr_rule) * lr0,
            num_steps=window // (k * self.bsz), seed=seed, evaluate=evaluate,
            full_train=self.b.metric == "full_train/loss")

    def run_unit(self, step: int, k: int) -> list[dict[str, Any]]:
        """The S records of branch multiplier k from checkpoint `step`."""
        state = self.restore(step)
        seeds = [int(s) for s in self.b.seeds]
        o = self._overrides(state, k)
        e0 = position(state)[1]
        window = branch_config.window_examples(self.config, e0)
        if self.vmap:
            c = spec.run_config(self.branch_config, o, drop=())
            out = branch_unit.VmappedBranch(
                c, branch_unit.unit_dir(self.workdir, step, k), self.parts, state, seeds,
                self._program(k), self._final).run()
        else:
            out = [dict(zip(("loss_ema", "train/loss", "full_train/loss"),
                            self.engine_branch(step, k, s), strict=True)) for s in seeds]
        return [{"point_step": step, "point_examples": e0, "k": k, "seed": s,
                 "batch_size": k * self.bsz, "reference_batch_size": self.bsz,
                 "learning_rate": o.learning_rate, "window_examples": window,
                 "steps": window // (k * self.bsz)} | out[i]
                for i, s in enumerate(seeds)]

    def engine_branch(self, step: int, k: int, seed: int) -> tuple[float, float, float]:
        """One seed's branch through the engine's Trainer (`branch_unit.engine_branch`)."""
        state = self.restore(step)
        o = self._overrides(state, k, seed, evaluate=self.b.metric == "full_train/loss")
        return branch_unit.engine_branch(
            spec.run_config(self.branch_config, o, drop=()),
            branch_unit.unit_dir(self.workdir, step, k, seed), state,
            ema_decay=branch_config.ema_decay_per_step(self.config, k), device_mesh=self.mesh,
            dataset=self.dataset)

    def remove_unit(self, step: int, k: int) -> None:
        """Removes the run directories of a unit whose records are written."""
        for seed in (None, *[int(s) for s in self.b.seeds]):
            d = branch_unit.unit_dir(self.workdir, step, k, seed)
            if paths.isdir(d):
                paths.rmtree(d)
        paths.rmdir(os.path.join(self.workdir, files.UNITS_DIR))


def run_reference(config: ml_collections.ConfigDict, workdir: str, *,
                  dataset: data.Dataset | None = None) -> None:
    """Trains (or resumes; skips when ended) the reference run, keeping every checkpoint."""
    c = branch_config.reference_run_config(config)
    ref_dir = os.path.join(workdir, files.REFERENCE_DIR)
    paths.makedirs(ref_dir)
    if loop.ended_run(ref_dir, c) is not None:  # a diverged reference run raises again
        return
    one = mesh.make_mesh(data=1, model=1, devices=jax.devices()[:1])  # small models: one device
    t = trainer.Trainer(c, ref_dir, mesh=one, dataset=dataset)
    try:
        t.run()
    finally:
        t.close()


def pending_units(config: ml_collections.ConfigDict, workdir: str, steps: Sequence[int],
                  shard: str | None = None) -> list[tuple[int, int]]:
    """This shard's (point step, k) units without records yet, in order."""
    units = [(s, int(k)) for s in steps for k in config.branch.ks]
    i, n = parse_shard(shard)
    mine = [u for j, u in enumerate(units) if j % n == i]
    done = {(r["point_step"], r["k"]) for r in
            shared.read_merged(os.path.join(workdir, files.BRANCHES_FILE), UNIT_KEYS)}
    return [u for u in mine if u not in done]


def write_definition(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Writes branch.json (the config and the numbers the report reads) before anything
    trains; refuses one of a different config, naming the differing fields."""
    definition = {
        "branch": config.branch.to_dict(),
        "reference_batch_size": branch_config.reference_batch(config),
        "window_examples": branch_config.window_examples(config),
        "learning_rate": float(config.optim.learning_rate), "optimizer": config.optim.name,
        "config": config.to_dict()}
    path = os.path.join(workdir, files.DEFINITION_FILE)
    previous = records.read_json(path)
    if previous is not None:
        old = previous.get("config") or {"branch": previous.get("branch", {})}
        changed = definition_diff({"config": old}, definition, ignored=OUTPUT_FIELDS)
        if changed:
            raise ValueError(f"{path} holds a branch study of a different config: "
                             f"{describe(changed)}; rerun with the original values, or use a "
                             "new workdir")
    paths.makedirs(workdir)
    records.write_json_atomic(path, definition)


def run_branches(config: ml_collections.ConfigDict, workdir: str, *, shard: str | None = None,
                 dataset: data.Dataset | None = None, log: Callable[[str], Any] = print,
                 stop_after: int | None = None) -> list[dict[str, Any]]:
    """Validates, then runs the reference and this shard's pending units; all records."""
    branch_config.validate_branch_config(config)
    parse_shard(shard)
    config_lib.validate(branch_config.reference_run_config(config), data_replicas=1,  # one device
                        model_names=models.model_names(),
                        dataset_names=None if dataset is not None else data.known_datasets())
    write_definition(config, workdir)
    run_reference(config, workdir, dataset=dataset)
    path = os.path.join(workdir, files.BRANCHES_FILE)
    runner = BranchRunner(config, workdir, dataset=dataset)
    try:
        ref = records.read_records(os.path.join(workdir, files.REFERENCE_DIR, files.METRICS_FILE))
        steps = branch_steps(config, runner.ckpt.all_steps(), ref)
        todo = pending_units(config, workdir, steps, shard)
        log(f"branches {workdir}: {len(steps)} points, {len(todo)} units to run"
            + (f" (shard {shard})" if shard else ""))
        enabled = bool(config.train.progress_bar) and jax.process_index() == 0
        with CountBar(len(todo), unit="unit", enabled=enabled, log=log) as bar:
            for step, k in todo[:stop_after]:
                preemption.check(f"before branch unit (step {step}, k={k})")
                shared.write_part(path, shared.part_name([f"s{step}_k{k}"]),
                                  runner.run_unit(step, k))  # shards never share a file
                runner.remove_unit(step, k)
                bar.update()
        if shard is None or parse_shard(shard)[0] == 0:
            preemption.check("before the reference-run noise measurement")
            branch_noise.measure_reference_noise(config, workdir, runner, steps)
    finally:
        runner.close()
    shared.export_parts(path, UNIT_KEYS)
    return shared.read_merged(path, UNIT_KEYS)
