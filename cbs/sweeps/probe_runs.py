"""The probe's branches: short runs at a few batch sizes from one checkpoint of any run, within
a budget, through `cbs.sweeps.branches.BranchRunner` (the arithmetic and letters:
`cbs.analysis.advice.probe`; B the run's batch at the checkpoint, b_0 the probe's smallest, k
its multipliers). The run's `config.json` becomes a branch study of one point (`probe_config`):
the batch constant at b_0, `branch.ks` = K, Δ of `probe.plan`, the compared loss the exact
training-set loss for in-memory data, else the EMA of the batch loss. Branch k trains at k·b_0
with peak rate f(k·b_0/B)·η_B (η_B the run's rate at B, f √ for Adam, linear for SGD). Files
in `out_dir` as a branch study's (`cbs.sweeps.branches`); a killed probe resumes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections

from cbs.analysis.advice import probe
from cbs.engine import lr
from cbs.results import calibration, files, records, shared
from cbs.runtime import checkpoint
from cbs.sweeps import branches
from cbs.sweeps.branch_config import default_branch_config

__all__ = ["run_probe"]


def probe_config(run_config: Mapping[str, Any], *, base: int, ks: Sequence[int],
                 seeds: Sequence[int], window: int, point_examples: int, epsilon: float,
                 tolerance: str, metric: str) -> ml_collections.ConfigDict:
    """The run's config as a branch study of one point (module docstring)."""
    c = ml_collections.ConfigDict(dict(run_config))
    c.batch.schedule = ml_collections.ConfigDict({"kind": "constant", "batch_size": int(base)})
    c.batch.lr_coupling.rule = "none"  # the branch sets each rate
    micro = int(c.batch.get("micro_batch", 0) or 0)
    if micro and base % micro:
        c.batch.micro_batch = math.gcd(micro, base)  # must divide every probe batch
    b = c.branch = default_branch_config()
    b.points_examples = (int(point_examples),)  # the checkpoint itself
    b.ks = tuple(int(k) for k in ks)
    b.lr_rule = "sqrt" if calibration.family(str(c.optim.name)) == "adaptive" else "linear"
    b.window_examples = int(window)
    b.metric = metric
    b.tolerance = tolerance
    b.epsilon = float(epsilon)
    b.seeds = tuple(int(s) for s in seeds)
    return c


def _rate_scale(config: ml_collections.ConfigDict, batch_size: int, base: int) -> float:
    """η_{b_0}/η_state: the run's coupling at B (its rate there), then f(b_0/B)."""
    rule = str(config.batch.lr_coupling.rule)
    coupling = 1.0
    if rule != "none":
        b_ref = int(config.batch.lr_coupling.base_batch_size or
                    config.batch.schedule.get("batch_size", 0) or batch_size)
        coupling = float(lr.lr_multiplier(batch_size, b_ref, rule))
    f_rule = "sqrt" if calibration.family(str(config.optim.name)) == "adaptive" else "linear"
    return coupling * float(lr.lr_multiplier(base, batch_size, f_rule))


def run_probe(run_dir: str, measured: Mapping[str, Any], out_dir: str, *,
              batch_sizes: Sequence[int] = (), seeds: int = 2,
              budget: float = probe.DEFAULT_BUDGET, unit: str = "examples",
              epsilon: float = 0.02, tolerance: str = "relative",
              log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Runs (or resumes) the probe's branches from the checkpoint `measured` describes
    (`cbs.train.measure_checkpoint`); returns {"rows": the branch records, "plan", "base":
    b_0, "ks", "seeds", "metric", "epsilon", "tolerance", "lr_scale"}."""
    raw = records.read_json(os.path.join(run_dir, files.CONFIG_FILE))
    if raw is None:
        raise FileNotFoundError(f"{run_dir} has no {files.CONFIG_FILE}: give the run directory "
                                "of `cbs-train --workdir=...`")
    if seeds < 1:
        raise ValueError(f"--probe_seeds={seeds}: give at least one data-order seed")
    step, e0, bsz = (int(measured[k]) for k in ("step", "examples_seen", "batch_size"))
    base, ks = probe.ladder(bsz, batch_sizes)
    plan = probe.plan(examples_seen=e0, steps_seen=step, base=base, ks=ks, seeds=seeds,
                      budget=budget, unit=unit)
    config = ml_collections.ConfigDict(raw)
    scale = _rate_scale(config, bsz, base)
    out = {"plan": plan, "base": base, "ks": ks, "seeds": seeds, "epsilon": epsilon,
           "tolerance": tolerance, "lr_scale": scale}
    for metric in ("full_train/loss", "loss_ema"):  # the exact loss where the data fit
        c = probe_config(raw, base=base, ks=ks, seeds=range(1, seeds + 1),
                         window=plan["window"], point_examples=e0, epsilon=epsilon,
                         tolerance=tolerance, metric=metric)
        runner = branches.BranchRunner(
            c, out_dir, checkpoints=os.path.join(run_dir, checkpoint.CHECKPOINT_DIR),
            lr_scale=scale)
        if runner.parts.in_memory or metric == "loss_ema":
            break
        runner.close()
    try:
        branches.write_definition(c, out_dir)
        path = os.path.join(out_dir, files.BRANCHES_FILE)
        todo = branches.pending_units(c, out_dir, [step])
        log(f"probe from {run_dir} at step {step}: {len(todo)} of {len(ks)} batch sizes to "
            f"run, window {plan['window']} examples")
        for s, k in todo:
            shared.write_part(path, shared.part_name([f"s{s}_k{k}"]), runner.run_unit(s, k))
            runner.remove_unit(s, k)
    finally:
        runner.close()
    shared.export_parts(path, branches.UNIT_KEYS)
    rows = [r for r in shared.read_merged(path, branches.UNIT_KEYS) if r["point_step"] == step]
    return out | {"rows": rows, "metric": metric}
