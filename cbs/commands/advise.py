"""How large should my batch be now? cbs-advise --workdir=RUN.

Reads a run directory (`config.json`, `metrics.jsonl`: its measured noise scale) and prints
the calibrated advice at its last measured step (`cbs.analysis.advice.advice`): the predicted
B_crit with its interval, the run's batch's cost in steps and examples against their minima
and, with --exchange=λ, the batch that minimises λ·steps + examples; writes the advice at
every measured step to advice.md, .json and .png in the run directory (or --out). With
--sweep_dir: the advice at each target of a sweep (prediction.md, .json, .png).

From a checkpoint (--checkpoint, --workdir with --step, or a --workdir whose records hold no
measured noise scale): measures the noise scale exactly at the restored state
(`cbs.train.measure_checkpoint`) and writes advice_STEP.md and .json. With --probe also the
task's own calibration (`cbs.sweeps.probe_runs`, records in probe_STEP/): the prediction with
the probed ratio of local B_crit to the noise scale beside the cross-task one
(`cbs.analysis.advice.probe`), and that calibration in calibration_STEP.json (for a run's live
advice: --config.noise.advice_calibration).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from absl import flags

from cbs.analysis.advice import advice, probe
from cbs.engine import trainer
from cbs.results import calibration, paths, records
from cbs.runtime import checkpoint, cli

__all__ = ["main", "run"]

_WORKDIR = flags.DEFINE_string("workdir", None, "A run directory (cbs-train --workdir=...).")
_SWEEP_DIR = flags.DEFINE_string("sweep_dir", None, "Instead of --workdir: a sweep directory; "
                                 "the advice at each target from the noise scale its trials "
                                 "recorded there (e.g. a one-run `predict` sweep).")
_SCALE = flags.DEFINE_enum("scale", "b_simple", ["b_simple", "b_noise"],
                           "The measured noise scale to predict from (b_noise needs "
                           "noise.curvature=True in the run).")
_EXCHANGE = flags.DEFINE_float("exchange", None, "λ: examples you would spend to save one "
                               "step (the best batch is √(λ·B_crit)).")
_LEVEL = flags.DEFINE_float("level", 0.8, "Level of the prediction interval.")
_OUT = flags.DEFINE_string("out", None, "Directory for advice.md and advice.png (default: the "
                           "run directory).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Instead of --workdir: a checkpoint of "
                                  "a run, RUN/checkpoints/STEP (or RUN/checkpoints: the "
                                  "latest); the noise scale is measured at that state.")
_STEP = flags.DEFINE_integer("step", None, "With --workdir: measure at this checkpoint "
                             "instead of reading the records.")
_EXAMPLES = flags.DEFINE_integer("examples", 0, "From a checkpoint: measure on this many "
                                 "training examples (0: all of them, exactly; needed when the "
                                 "training split is streamed).")
_PROBE = flags.DEFINE_bool("probe", False, "From a checkpoint (--checkpoint, or --workdir: "
                           "--step or the latest): also run short branches at a few batch "
                           "sizes and combine the task's own ratio of local B_crit to the "
                           "noise scale with the cross-task calibration.")
_PROBE_BUDGET = flags.DEFINE_float("probe_budget", probe.DEFAULT_BUDGET, "The probe's branches "
                                   "train at most this fraction of the run so far "
                                   "(--probe_unit).")
_PROBE_UNIT = flags.DEFINE_enum("probe_unit", "examples", list(probe.UNITS), "What the budget "
                                "counts: examples (compute) or steps (wall time of a device "
                                "that a larger batch does not saturate).")
_PROBE_BATCH_SIZES = flags.DEFINE_list("probe_batch_sizes", [], "The probe's batch sizes, each "
                                       "a multiple of the smallest (default: B/2, B, 2B, 4B, "
                                       "8B with B the run's batch there).")
_PROBE_SEEDS = flags.DEFINE_integer("probe_seeds", 2, "Data-order seeds per batch size.")
_PROBE_EPSILON = flags.DEFINE_float("probe_epsilon", 0.02, "ε of the branch criterion, a "
                                    "fraction of the loss (a batch passes while its loss is "
                                    "within ε of every smaller batch's).")
flags.mark_flags_as_mutual_exclusive(["workdir", "sweep_dir", "checkpoint"], required=True)


def main(argv: list[str]) -> None:
    del argv
    if not 0 < _LEVEL.value < 1:
        raise ValueError(f"--level must be in (0, 1), got {_LEVEL.value}")
    if _EXCHANGE.value is not None and not 0 < _EXCHANGE.value < math.inf:
        raise ValueError(f"--exchange={_EXCHANGE.value:g}: λ is the examples you would spend to "
                         "save one step, a number > 0 (e.g. --exchange=100); leave it out for "
                         "no best batch")
    if _EXAMPLES.value < 0:
        raise ValueError(f"--examples={_EXAMPLES.value}: give a number of training examples "
                         "> 0, or 0 for all of them")
    scale, level, exchange = str(_SCALE.value), float(_LEVEL.value), _EXCHANGE.value
    if _PROBE.value or _CHECKPOINT.value or _STEP.value is not None:
        if _PROBE.value and _SWEEP_DIR.value:
            raise ValueError("--probe branches from a checkpoint of a run: give --checkpoint="
                             "RUN/checkpoints/STEP or --workdir=RUN, not --sweep_dir")
        where, step = _checkpoint_of()
        if _PROBE.value and not _has_checkpoint(where):
            raise ValueError(f"--probe branches from a checkpoint: {where} has no "
                             f"{checkpoint.CHECKPOINT_DIR}/ (rerun it with "
                             "--config.train.checkpoint_every=100)")
        _from_checkpoint(where, step, scale=scale, level=level, exchange=exchange)
        return
    if _SWEEP_DIR.value:
        where, name = str(_SWEEP_DIR.value), "prediction"
        advices = advice.from_sweep(where, scale=scale, level=level, exchange=exchange)
    else:
        where, name = cli.required(_WORKDIR), "advice"
        advices = advice.trajectory(where, scale=scale, level=level, exchange=exchange)
        if not advices and _has_checkpoint(where):  # no measured noise: measure at the latest
            print(f"{where} records no measured {scale}: measuring it at the latest checkpoint "
                  f"({'all' if not _EXAMPLES.value else _EXAMPLES.value} training examples)")
            _from_checkpoint(where, None, scale=scale, level=level, exchange=exchange)
            return
    if not advices:
        raise ValueError(_nothing_measured(where, scale, bool(_SWEEP_DIR.value)))
    out, text = _OUT.value or where, f"{advice.summary(advices[-1])}\n\n{advice.table(advices)}"
    paths.makedirs(out)
    records.write_atomic(os.path.join(out, f"{name}.md"),
                         f"# Batch-size advice from `{where}`\n\n{text}\n")
    records.write_json_atomic(os.path.join(out, f"{name}.json"), {"advice": json.loads(
        json.dumps([a.to_dict() for a in advices], default=float))})
    advice.figure(advices, os.path.join(out, f"{name}.png"))
    print(text)


def _nothing_measured(where: str, scale: str, sweep: bool) -> str:
    """What is true and what to run when `where` has no measured noise scale to advise from."""
    curvature = " --config.noise.curvature=True" if scale == "b_noise" else ""
    if sweep:
        return (f"{where}: no trial recorded {scale} at a target crossing: either none "
                "reached a target (see its report), or the sweep measured no noise at its "
                f"evaluations (rerun it with --config.noise.examples=auto{curvature})")
    return (f"{where} records no measured {scale} and has no checkpoint to measure it at: "
            f"rerun it with --config.noise.every=100{curvature} (an exact measurement every 100 "
            "steps) or --config.train.checkpoint_every=100 (then this command measures at the "
            "latest checkpoint)")


def _checkpoint_of() -> tuple[str, int | None]:
    """(run directory, step or None for the latest) of --checkpoint, or --workdir --step."""
    if not _CHECKPOINT.value:
        return cli.required(_WORKDIR), _STEP.value
    if _STEP.value is not None:
        raise ValueError("--step goes with --workdir; --checkpoint names its step: "
                         "--checkpoint=RUN/checkpoints/STEP")
    path = str(_CHECKPOINT.value).rstrip("/")  # not normpath: it makes gs://b of gs:/b
    head, tail = os.path.split(path if paths.is_remote(path) else os.path.normpath(path))
    if tail.isdigit() and os.path.basename(head) == checkpoint.CHECKPOINT_DIR:
        return os.path.dirname(head), int(tail)
    if tail == checkpoint.CHECKPOINT_DIR:
        return head, None
    raise ValueError(f"--checkpoint={_CHECKPOINT.value}: give RUN/{checkpoint.CHECKPOINT_DIR}/"
                     f"STEP (one checkpoint) or RUN/{checkpoint.CHECKPOINT_DIR} (the latest)")


def _has_checkpoint(workdir: str) -> bool:
    return paths.isdir(os.path.join(workdir, checkpoint.CHECKPOINT_DIR))


def _from_checkpoint(workdir: str, step: int | None, *, scale: str, level: float,
                     exchange: float | None) -> None:
    """Measures at the checkpoint, prints the advice, writes advice_STEP.md and .json."""
    measured = trainer.measure_checkpoint(workdir, step, examples=int(_EXAMPLES.value),
                                          curvature=scale == "b_noise")
    a = advice.from_checkpoint(measured, scale=scale, level=level, exchange=exchange)
    out = _OUT.value or workdir
    paths.makedirs(out)
    name = f"advice_{measured['step']}"
    text, extra = advice.summary(a), dict[str, Any]()
    if _PROBE.value:
        probed, extra = _probe(workdir, measured, out, scale=scale, level=level)
        text += "\n\n" + probed
    records.write_atomic(os.path.join(out, f"{name}.md"), "# Batch-size advice from "
                         f"`{workdir}` at checkpoint {measured['step']}\n\n{text}\n")
    records.write_json_atomic(os.path.join(out, f"{name}.json"), json.loads(json.dumps({
        "advice": a.to_dict(), "measured": measured} | extra, default=float)))
    print(text)


def _probe(workdir: str, measured: dict, out: str, *, scale: str, level: float
           ) -> tuple[str, dict]:
    """Runs the probe at the measured checkpoint; (its summary, {"probe": what it found}) and
    writes calibration_STEP.json (the calibration with the probed ratio)."""
    from cbs.sweeps import probe_runs

    step = int(measured["step"])
    sizes = [int(b) for b in _PROBE_BATCH_SIZES.value]
    ran = probe_runs.run_probe(workdir, measured, os.path.join(out, f"probe_{step}"),
                               batch_sizes=sizes, seeds=int(_PROBE_SEEDS.value),
                               budget=float(_PROBE_BUDGET.value), unit=str(_PROBE_UNIT.value),
                               epsilon=float(_PROBE_EPSILON.value))
    ratio = probe.local_ratio(ran["rows"], float(measured.get(f"noise/{scale}", math.nan)),
                              epsilon=ran["epsilon"], tolerance=ran["tolerance"],
                              metric=ran["metric"])
    calib = calibration.shipped()
    combined = probe.combine(calib["models"][scale], str(measured["optimizer"]), ratio,
                             level=level)
    spent: dict[str, Any] = dict(probe.cost(ran["rows"]))
    plan = ran["plan"]
    spent |= {"base": ran["base"], "window": plan["window"], "budget": plan["budget"],
              "unit": plan["unit"], "fraction_examples": spent["examples"] / max(
                  int(measured["examples_seen"]), 1),
              "fraction_steps": spent["steps"] / max(step, 1)}
    if ratio["bound"] == "":
        records.write_json_atomic(os.path.join(out, f"calibration_{step}.json"),
                                  probe.calibration_with(calib, scale, str(measured["optimizer"]),
                                                         combined))
    found = {"ratio": ratio, "combined": combined, "cost": spent, "plan": plan,
             "metric": ran["metric"], "epsilon": ran["epsilon"], "tolerance": ran["tolerance"],
             "lr_scale": ran["lr_scale"]}
    return probe.summary(ratio, combined, spent, scale), {"probe": found}


def run() -> None:
    """The `cbs-advise` console script (and `python -m experiments.advise`)."""
    cli.run(main, outputs=("out", "workdir", "sweep_dir"))


if __name__ == "__main__":
    run()
