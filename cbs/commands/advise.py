"""How large should my batch be now? python -m experiments.advise --workdir=RUN.

Reads a run directory (`config.json`, `metrics.jsonl`: the run's measured noise scale) and
prints the calibrated advice at its last measured step (`cbs.analysis.advice`): the predicted
B_crit with its prediction interval, what the run's batch costs in steps and examples against
their minima, and with --exchange=λ the batch that minimises λ·steps + examples. Writes the
advice at every measured step to advice.md and advice.png in the run directory (or --out).
"""

from __future__ import annotations

import json
import os

from absl import flags

from cbs.analysis import advice
from cbs.engine import cli
from cbs.results import records

_WORKDIR = flags.DEFINE_string("workdir", None, "A run directory (python -m experiments.main "
                               "--workdir=...).")
_SCALE = flags.DEFINE_enum("scale", "b_simple", ["b_simple", "b_noise"],
                           "The measured noise scale to predict from (b_noise needs "
                           "noise.curvature=True in the run).")
_EXCHANGE = flags.DEFINE_float("exchange", None, "λ: examples you would spend to save one "
                               "step (the best batch is √(λ·B_crit)).")
_LEVEL = flags.DEFINE_float("level", 0.8, "Level of the prediction interval.")
_OUT = flags.DEFINE_string("out", None, "Directory for advice.md and advice.png (default: the "
                           "run directory).")
flags.mark_flags_as_required(["workdir"])


def main(argv: list[str]) -> None:
    del argv
    run_dir = cli.required(_WORKDIR)
    if not 0 < _LEVEL.value < 1:
        raise ValueError(f"--level must be in (0, 1), got {_LEVEL.value}")
    advices = advice.trajectory(run_dir, scale=_SCALE.value, level=_LEVEL.value,
                                exchange=_EXCHANGE.value)
    if not advices:
        raise ValueError(f"{run_dir} has no measured {_SCALE.value} yet: run with a noise "
                         "estimate (config.noise.live or noise.every > 0"
                         + (", noise.curvature=True" if _SCALE.value == "b_noise" else "")
                         + ") and evaluations")
    out = _OUT.value or run_dir
    text = advice.table(advices)
    records.write_atomic(os.path.join(out, "advice.md"), "# Batch-size advice along "
                         f"`{run_dir}`\n\n{advice.summary(advices[-1])}\n\n{text}\n")
    records.write_json_atomic(os.path.join(out, "advice.json"), {"advice": json.loads(
        json.dumps([a.to_dict() for a in advices], default=float))})
    advice.figure(advices, os.path.join(out, "advice.png"))
    print(advice.summary(advices[-1]))
    print()
    print(text)


def run() -> None:
    """The `cbs-advise` console script (and `python -m experiments.advise`)."""
    cli.run(main, outputs=("out", "workdir"))


if __name__ == "__main__":
    run()
