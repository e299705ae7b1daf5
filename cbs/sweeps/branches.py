"""Local critical batch size by branched training (Merrill, Arora, Groeneveld, Hajishirzi 2025,
"Critical Batch Size Revisited", arXiv 2505.23971, Sec. 3).

Letters: B the reference run's batch, η_0 its peak learning rate, E examples seen at a branch
point, k a batch multiplier from the ladder K, Δ the window in examples, S the branch seeds.

1. A reference run at (B, η_0) is an ordinary engine run (`Trainer.run`, one device) in
   `workdir/reference`, checkpointing every `train.checkpoint_every` steps (all kept).
2. Branch points are checkpoints of it, chosen by examples seen or by the first crossing of a
   smoothed training loss (`branch.points_examples`, `branch.points_losses`).
3. From each point and for each k in K: restore the checkpoint, train Δ examples at batch k·B
   with peak learning rate f(k)·η_0 (f(k) = k "linear" for SGD, √k "sqrt" for Adam), i.e.
   Δ/(k·B) steps; record the EMA of the batch loss at the end of the window and, optionally, the
   exact full training-set loss. The EMA decays by `loss_ema_decay` per step of the branch
   (`loss_ema_per="step"`, the paper's α = 0.5) or per B examples (`"reference_batch"`: decay^k
   per step of branch k, so every branch averages the same number of examples).
4. Each (point, k) is a unit: a run of the engine's one loop (`cbs.sweeps.branch_unit`) that
   starts at the point's step and examples seen. Its S data-order seeds (stream seeds of
   `cbs.data`) run as one vmapped program (`VmappedBranch`: `cbs.engine.vmapped.vmapped_steps`,
   the `jax.vmap` of a `fori_loop` of `TrainStep.apply` that `cbs.sweeps.groups` also runs), or,
   with `branch.vmap=False` or a streamed dataset, one `Trainer` per seed started from the
   point's state (`branch_unit.engine_branch`). The k of one seed read the same stream
   positions [E, E + Δ), so their losses differ by the batch size and learning rate alone
   (common random numbers), not by the examples drawn.

k*, B* and their uncertainty are computed from the records by `cbs.analysis.branch_report`.

Files in `workdir`: `branch.json` (definition), `reference/` (engine run), `branches.d/`
(one record per (point, k, seed), a write-once part per (point, k), so shards on any file
system lose none of each other's; `cbs.results.records.write_part`), `branches.jsonl` (the
records of older versions, then an export of the parts; readers merge both:
`records.read_merged(path, UNIT_KEYS)`), `reference_noise.jsonl` (`cbs.sweeps.branch_noise`,
when measured), and `units/` while a unit runs (its loop's run directory, removed once its
records are written).
A killed run resumes: finished (point, k) units are skipped and an unfinished one is run
again from its point (or from the checkpoint its loop saved at the end of its window), so the
records equal an uninterrupted run's. `shard="i/n"` runs only units whose
index ≡ i (mod n).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections

from cbs import data
from cbs.engine import checkpoint, mesh, preemption, progress, spec, trainer
from cbs.engine.counts import position
from cbs.engine.lr import EXPONENTS, lr_multiplier
from cbs.engine.parts import RunParts
from cbs.engine.step import TrainState, TrainStep
from cbs.engine.vmapped import vmapped_steps
from cbs.engine.writer import CountBar
from cbs.results import files, paths, records
from cbs.results.store import OUTPUT_FIELDS, definition_diff, describe
from cbs.sweeps import branch_noise, branch_unit
from cbs.sweeps.grid import parse_shard

UNIT_KEYS = ("point_step", "k", "seed")  # what identifies a branch record

LR_RULES = tuple(r for r, p in EXPONENTS.items() if p > 0)  # f(k) = k^p must grow with k
METRICS = ("loss_ema", "full_train/loss")
EMA_UNITS = ("step", "reference_batch")
CRITERIA = ("paper", "ladder")
B_STAR_RULES = ("k_star", "geometric")
# Δ of the paper: 2 billion tokens with OLMo's B = 1024 documents × 4096 tokens, i.e. ≈ 477
# steps at B; in reference steps, rounded up to a power of two (Merrill et al. 2025, Sec. 3.1).
PAPER_WINDOW_STEPS = 512


def default_branch_config() -> ml_collections.ConfigDict:
    """`config.branch`, with the paper's choices as defaults (Merrill et al. 2025, Sec. 3.1).

    The paper's values (its Sec. 3.1 "implementation details" 1–3 as quoted by three
    independent readings; see README, "Local critical batch size by branched training"):
    Δ = 2B tokens (two billion: ≈ 477 OLMo steps at B), ε = 0.01 nats, EMA α = 0.5 on the
    per-step loss, f(k) = √k for Adam (k for SGD), k* the largest k whose smoothed loss is
    within ε of every smaller k, reported as B* = k*·B. The k ladder is ours (the paper lists
    its grids per checkpoint in its App. A). `window_fraction` and the reference-noise fields
    are ours (off by default)."""
    b = ml_collections.ConfigDict()
    b.points_examples = ()  # branch at the last checkpoint at or before these examples seen
    b.points_losses = ()  # ... and where the reference's smoothed train loss first falls to these
    b.ks = (1, 2, 4, 8, 16, 32)  # batch multipliers k (branch batch k·B); must start at 1
    b.lr_rule = "sqrt"  # f(k): "sqrt" η = √k·η_0 (Adam, the paper's), "linear" η = k·η_0 (SGD)
    b.window_examples = 0  # Δ, examples each branch trains on; 0 = 512·B, rounded up to a
    #   multiple of lcm(ks)·B (the paper's 2B tokens ≈ 477 steps at B, Sec. 3.1)
    b.window_fraction = 0.0  # > 0: Δ = this fraction of the examples seen at the branch point,
    #   rounded up to a multiple of lcm(ks)·B (windows short against the training before
    #   them at every point); 0 = the fixed Δ above
    b.epsilon = 0.01  # ε: k passes if its loss ≤ min over smaller k + ε (paper: 0.01 nats)
    b.tolerance = "absolute"  # ε in nats ("absolute", paper) or as a fraction of that min
    #   ("relative")
    b.criterion = "paper"  # "paper": k* = largest k within ε of every smaller k; "ladder": the
    #   same, but the first failing k ends the ladder (a lucky larger k does not count)
    b.b_star = "k_star"  # reported B*: "k_star" k*·B (paper); "geometric" √(k*·k⁺)·B, the
    #   log-midpoint between the last passing and the first failing batch
    b.loss_ema_decay = 0.5  # EMA decay of the batch loss (paper: α = 0.5)
    b.loss_ema_per = "step"  # the decay applies per step of each branch ("step", paper) or per
    #   B examples ("reference_batch": decay^k per step of branch k)
    b.metric = "loss_ema"  # compared loss: "loss_ema" (paper) or "full_train/loss" (exact)
    b.seeds = (1, 2, 3)  # data-order seeds of the branches (their spread is B*'s interval)
    b.vmap = True  # the seeds of one (point, k) as one vmapped program (in-memory data)
    b.noise_checkpoints = 0  # > 0: B_simple and B_noise measured exactly on the whole training
    #   set at every branch point and this many log-spaced reference checkpoints (in-memory
    #   data; `branch_noise.NOISE_ESTIMATOR`); 0 = off
    b.noise_deviations = 256  # m, random examples whose deviations give tr(HΣ) (O(m) HVPs)
    b.noise_seed = 0  # draw of those m examples
    return b


def validate_branch_config(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the `branch.*` (or engine) field to change."""
    b = config.branch
    ks = [int(k) for k in b.ks]
    if not ks or ks[0] != 1 or any(y <= x for x, y in zip(ks, ks[1:], strict=False)):
        raise ValueError(f"branch.ks={tuple(b.ks)}: give increasing multipliers starting at 1")
    if b.lr_rule not in LR_RULES:
        raise ValueError(f"branch.lr_rule={b.lr_rule!r}: use one of {sorted(LR_RULES)}")
    if b.tolerance not in ("absolute", "relative") or not b.epsilon > 0:
        raise ValueError("branch.tolerance must be 'absolute' or 'relative' and branch.epsilon"
                         " > 0")
    if b.metric not in METRICS:
        raise ValueError(f"branch.metric={b.metric!r}: use one of {METRICS}")
    for field, known in (("loss_ema_per", EMA_UNITS), ("criterion", CRITERIA),
                         ("b_star", B_STAR_RULES)):
        if b.get(field, known[0]) not in known:
            raise ValueError(f"branch.{field}={b[field]!r}: use one of {known}")
    if not 0 <= b.loss_ema_decay < 1:
        raise ValueError(f"branch.loss_ema_decay={b.loss_ema_decay}: must be in [0, 1)")
    if not 0 <= float(b.get("window_fraction", 0.0)) <= 1:
        raise ValueError(f"branch.window_fraction={b.window_fraction}: must be in [0, 1]")
    if not b.seeds:
        raise ValueError("branch.seeds: give at least one data-order seed")
    if not (b.points_examples or b.points_losses):
        raise ValueError("branch.points_examples or branch.points_losses: give branch points")
    if config.batch.schedule.kind != "constant" or config.batch.lr_coupling.rule != "none":
        raise ValueError("batch.schedule.kind must be 'constant' and batch.lr_coupling.rule "
                         "'none' for the reference run of a branch study")
    big, unit = window_examples(config), _ladder_lcm(ks) * reference_batch(config)
    if big % unit:
        raise ValueError(f"branch.window_examples={big} must be a multiple of lcm(ks)·B = "
                         f"{unit} (a whole number of steps for every k)")


def reference_batch(config: ml_collections.ConfigDict) -> int:
    """B, the reference run's batch size."""
    return int(config.batch.schedule.batch_size)


def _ladder_lcm(ks: Sequence[int]) -> int:
    return math.lcm(*[int(k) for k in ks])


def window_examples(config: ml_collections.ConfigDict, examples_seen: int | None = None) -> int:
    """Δ in examples: with `branch.window_fraction` > 0 and the branch point's examples seen,
    that fraction of them rounded up to a multiple of lcm(ks)·B; else
    `branch.window_examples`, or PAPER_WINDOW_STEPS·B rounded up to a multiple of lcm(ks)·B."""
    b, bsz = config.branch, reference_batch(config)
    frac = float(b.get("window_fraction", 0.0))
    if frac and examples_seen is not None:
        unit = _ladder_lcm(b.ks) * bsz
        return max(unit, -(-math.ceil(frac * examples_seen) // unit) * unit)
    if int(b.window_examples):
        return int(b.window_examples)
    unit = _ladder_lcm(b.ks)
    return -(-PAPER_WINDOW_STEPS // unit) * unit * bsz


def ema_decay_per_step(config: ml_collections.ConfigDict, k: int) -> float:
    """The EMA decay per step of branch k (see `branch.loss_ema_per`)."""
    b = config.branch
    decay = float(b.loss_ema_decay)
    return decay ** k if b.get("loss_ema_per", "step") == "reference_batch" else decay


def lr_factor(k: int, rule: str) -> float:
    """f(k): k for "linear" (SGD), √k for "sqrt" (Adam)."""
    return float(lr_multiplier(k, 1, rule))


def branch_steps(config: ml_collections.ConfigDict, ckpt_steps: Sequence[int],
                 reference: Sequence[dict[str, Any]]) -> list[int]:
    """Checkpoint steps to branch from (sorted, unique), from `branch.points_*`.

    `reference`: the reference run's train records (step, train/loss)."""
    b, bsz = config.branch, reference_batch(config)
    ckpts = sorted(s for s in ckpt_steps if s > 0)
    out = set()
    for e in b.points_examples:
        before = [s for s in ckpts if s * bsz <= e]
        if before:
            out.add(before[-1])
    train_recs = sorted((r for r in reference if r.get("kind") == "train"),
                        key=lambda r: r["step"])
    ema = progress.ema_curve([r["train/loss"] for r in train_recs], float(b.loss_ema_decay))
    for target in b.points_losses:
        hit = [r["step"] + 1 for r, v in zip(train_recs, ema, strict=True) if v <= target]
        before = [s for s in ckpts if hit and s <= hit[0]]
        if before:
            out.add(before[-1])
    return sorted(out)


class BranchRunner:
    """Runs the branches of one study; `run_unit(step, k)` returns a unit's records."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, *,
                 dataset: data.Dataset | None = None):
        validate_branch_config(config)
        self.config, self.workdir, self.b = config, workdir, config.branch
        self.bsz = reference_batch(config)
        self.ks = [int(k) for k in self.b.ks]
        c = spec.run_config(config, spec.RunOverrides(
            noise_every=0,  # no per-example measurements inside branches
            schedule=dict(config.batch.schedule.to_dict(),
                          batch_size=self.ks[-1] * self.bsz),  # sizes checked up to max k
            eval_enabled=False), drop=())
        self.branch_config = c
        self.dataset = dataset
        one = mesh.make_mesh(data=1, model=1, devices=jax.devices()[:1])
        self.mesh, self.rep = one, mesh.replicated(one)
        self.parts = RunParts(c, mesh=one, dataset=dataset)
        self.vmap = bool(self.b.vmap) and self.parts.in_memory
        self.ckpt = checkpoint.Checkpointer(
            os.path.join(workdir, files.REFERENCE_DIR, checkpoint.CHECKPOINT_DIR), max_to_keep=None)
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
            return data.device_batch(ds, inputs["arrays"], examples_seen, batch_size,
                                     seed=inputs["seed"])

        return self.parts.make_step(batch_fn, self.rep)

    def restore(self, step: int) -> TrainState:
        """The reference state after `step` updates, on this runner's device."""
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.rep),
                              self.parts.abstract_state())
        state, _ = self.ckpt.restore(step, target)
        return state

    def _final_loss_fn(self) -> Callable | None:
        """jit of states[S] -> the full training-set loss of each, or None (not measured)."""
        if self.b.metric != "full_train/loss":
            return None
        fn, arrays = self.parts.eval_sums_fn("train", self.config.eval.train_examples)

        def loss(state):
            sums = fn(state.params, state.model_state, arrays)
            return sums["loss_sum"] / sums["count"]

        return jax.jit(jax.vmap(loss))

    def window(self, examples_seen: int) -> int:
        """Δ of the branches from a point that has seen `examples_seen` examples."""
        return window_examples(self.config, examples_seen)

    def _program(self, k: int) -> Callable:
        """jit(vmap over seeds) of branch k: (states[S], seeds[S], loss_ema[S], n) ->
        (states, loss_ema, last_loss) after n steps (n traced: one compilation per k)."""
        if k in self._programs:
            return self._programs[k]
        steps = vmapped_steps(self.step.apply, self.parts.accum_steps(k * self.bsz),
                              ema_decay_per_step(self.config, k),
                              inputs_axes={"arrays": None, "seed": 0})  # a stream per seed
        arrays = self.parts.train_arrays

        def program(states, seeds, ema, n):
            return steps(states, {"arrays": arrays, "seed": seeds}, ema, n)

        self._programs[k] = jax.jit(program)
        return self._programs[k]

    def _overrides(self, state: TrainState, k: int, seed: int | None = None,
                   evaluate: bool = True) -> spec.RunOverrides:
        e0 = position(state)[1]
        lr0 = float(jax.device_get(state.learning_rate))
        return branch_unit.branch_overrides(
            state, batch_size=k * self.bsz, learning_rate=lr_factor(k, self.b.lr_rule) * lr0,
            num_steps=self.window(e0) // (k * self.bsz), seed=seed, evaluate=evaluate,
            full_train=self.b.metric == "full_train/loss")

    def run_unit(self, step: int, k: int) -> list[dict[str, Any]]:
        """The S records of branch multiplier k from checkpoint `step` (each branch a run of
        the engine's loop, `cbs.sweeps.branch_unit`)."""
        state = self.restore(step)
        seeds = [int(s) for s in self.b.seeds]
        o = self._overrides(state, k)
        e0 = position(state)[1]
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
                 "learning_rate": o.learning_rate, "window_examples": self.window(e0),
                 "steps": self.window(e0) // (k * self.bsz)} | out[i]
                for i, s in enumerate(seeds)]

    def engine_branch(self, step: int, k: int, seed: int) -> tuple[float, float, float]:
        """One branch through the engine's own Trainer, jitted step, input pipeline and loop
        (data-order seed `seed`): (loss_ema, last batch loss, final metric or NaN)."""
        state = self.restore(step)
        o = self._overrides(state, k, seed, evaluate=self.b.metric == "full_train/loss")
        return branch_unit.engine_branch(
            spec.run_config(self.branch_config, o, drop=()),
            branch_unit.unit_dir(self.workdir, step, k, seed), state,
            ema_decay=ema_decay_per_step(self.config, k), device_mesh=self.mesh,
            dataset=self.dataset)

    def remove_unit(self, step: int, k: int) -> None:
        """Removes the run directories of a unit whose records are appended."""
        for seed in (None, *[int(s) for s in self.b.seeds]):
            d = branch_unit.unit_dir(self.workdir, step, k, seed)
            if paths.isdir(d):
                paths.rmtree(d)
        units = os.path.join(self.workdir, files.UNITS_DIR)
        if paths.isdir(units) and not any(paths.epath(units).iterdir()):
            paths.epath(units).rmdir()


def run_reference(config: ml_collections.ConfigDict, workdir: str, *,
                  dataset: data.Dataset | None = None) -> None:
    """Trains (or resumes; skips when ended) the reference run, keeping every checkpoint."""
    c = spec.run_config(config, spec.RunOverrides(  # branch points need old checkpoints
        keep_checkpoints=1_000_000), drop=())
    ref_dir = os.path.join(workdir, files.REFERENCE_DIR)
    paths.makedirs(ref_dir)
    status = records.read_json(os.path.join(ref_dir, files.STATUS_FILE))
    if status and status.get("status") in ("finished", "stopped") and status.get(
            "config_hash") == trainer.config_hash(c):
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
            records.read_merged(os.path.join(workdir, files.BRANCHES_FILE), UNIT_KEYS)}
    return [u for u in mine if u not in done]


def write_definition(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Writes branch.json (the whole config, and the numbers the report reads) before anything
    trains; a workdir whose branch.json holds a different config is refused in one line
    naming the differing fields (a branch.json of an older version is compared on the fields
    it holds)."""
    definition = {
        "branch": config.branch.to_dict(), "reference_batch_size": reference_batch(config),
        "window_examples": window_examples(config),
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
    """Reference run, then this shard's pending branch units; returns all branch records.

    `stop_after`: run at most this many units (tests: an interrupted study)."""
    validate_branch_config(config)
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
            for i, (step, k) in enumerate(todo):
                if stop_after is not None and i >= stop_after:
                    break
                preemption.check(f"before branch unit (step {step}, k={k})")
                records.write_part(path, records.part_name([f"s{step}_k{k}"]),
                                   runner.run_unit(step, k))  # shards never share a file
                runner.remove_unit(step, k)
                bar.update()
        if shard is None or parse_shard(shard)[0] == 0:
            preemption.check("before the reference-run noise measurement")
            branch_noise.measure_reference_noise(config, workdir, runner, steps)
    finally:
        runner.close()
    if records.part_paths(path):
        records.export_parts(path, UNIT_KEYS)
    return records.read_merged(path, UNIT_KEYS)
