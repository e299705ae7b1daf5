"""Batch ramps on digits: the Llama 3, DeepSeek-V3 and adaptive shapes as single runs, and
the study that runs them beside the digits sweep (docs/guides/ramps.md).

    cbs-train --config=digits_ramps:llama3 --workdir=/tmp/l3      # one ramp (also :deepseek,
    cbs-train --config=digits_ramps:adaptive --workdir=/tmp/ad    #   :adaptive,calibrated)
    cbs-ramps --config=digits_ramps --sweep_dir=runs/digits       # the study

A single ramp is the digits sweep's run config with a batch-size schedule (`ramp_run`):
`:llama3` (`STEP`, Llama 3 405B's two doublings placed where the digits sweep's B_crit passes
the batch) and `:deepseek` (`LINEAR`, DeepSeek-V3's ramp as 32 → 160 examples); expected for
both: full_train/loss ≈ 0.05 within about 200 steps. `:adaptive` (`ADAPTIVE`): every 10 steps
B moves on the ladder 16, 32, ..., 1024 towards k·B_simple of the live estimate
(`cbs.engine.adaptive.Adaptive`); expected: B climbs from 16 to a few hundred as B_simple
grows from ~30 to ~100+. `:adaptive,calibrated` targets the calibrated B_crit (k·r̂·B_simple,
Adam's r̂ from the shipped calibration; each train record's `advice/b_crit`).

The study (no ramp named) finishes the digits sweep in sweep_dir if needed, then runs fixed
small and large batches (at the sweep's best rate at their B) and each ramp (from the best
rate at its first B) until the full training loss crossed every target, and rewrites the
report ("Batch-size ramps": S and E per target; figures/ramps_L*.png: the S–E frontiers).
"""

from __future__ import annotations

import ml_collections

from cbs.configs import base, digits_sweep

__all__ = ["ADAPTIVE", "LINEAR", "STEP", "fixed", "get_config"]

STEP = {"kind": "step", "steps": ((0, 32), (1_500, 64), (4_000, 128))}  # Llama 3's shape
LINEAR = {"kind": "linear", "start": 32, "end": 160, "over": 4_000, "multiple": 16}  # DeepSeek
ADAPTIVE = {"kind": "adaptive", "min_batch": 16, "max_batch": 1024, "initial": 16,
            "factor": 2, "k": 1.0, "patience": 3, "source": "b_simple", "multiple": 16}
_RUNS: dict[str, tuple[dict, int, float]] = {  # name: (schedule, B_0, η_0)
    "llama3": (STEP, 32, 5e-3), "deepseek": (LINEAR, 32, 5e-3), "adaptive": (ADAPTIVE, 16, 4e-3),
}


def ramp_run(arg: str, schedule: dict, *, base_batch_size: int, learning_rate: float
             ) -> ml_collections.ConfigDict:
    """The digits sweep's run config with a batch-size schedule and square-root coupling."""
    c = digits_sweep.get_config(arg)
    del c["sweep"]
    c.batch.micro_batch = 16  # m fixed; B changes through the accumulation count
    c.batch.schedule = ml_collections.ConfigDict(dict(schedule))  # the ramp
    c.batch.lr_coupling.rule = "sqrt"  # η = η_0·(B/B_0)^½ at every change
    c.batch.lr_coupling.base_batch_size = base_batch_size  # B_0, the first batch size
    c.batch.lr_coupling.cap = 0.03  # largest η allowed (Adam diverges above)
    c.optim.learning_rate = learning_rate  # η_0 at B_0
    c.train.max_steps = 2000  # updates
    c.eval.every = 10  # evaluation (with the full training-set loss) every 10 steps
    c.noise.every = 50  # exact noise statistics every 50 steps
    c.noise.examples = "step"  # on the step's examples only, not at evaluations as the sweep
    c.noise.batch_size = 0  # one micro-batch
    c.noise.curvature = False  # B_simple only
    c.noise.deviations = c.noise.hessian_batch_size = c.noise.chunk_size = 0  # (curvature off)
    return c


def fixed(batch_size: int) -> dict:
    return {"label": f"fixed B={batch_size}", "micro_batch": batch_size,
            "schedule": {"kind": "constant", "batch_size": batch_size},
            "learning_rate": f"best@{batch_size}"}


def _ramp(label: str, schedule: dict, first: int) -> dict:
    return {"label": label, "micro_batch": 16, "schedule": schedule,
            "learning_rate": f"best@{first}",
            "lr_coupling": {"rule": "sqrt", "base_batch_size": first, "cap": 0.03}}


def get_config(arg: str = ""):
    words = base.parse_arg(arg, ("tiny", "calibrated", *_RUNS))
    named = sorted(words & set(_RUNS))
    if len(named) > 1 or ("calibrated" in words and named != ["adaptive"]):
        raise ValueError(f"digits_ramps:{arg}: name at most one ramp of {', '.join(_RUNS)} "
                         "('calibrated' goes with 'adaptive')")
    size = ",".join(sorted(words & {"tiny"}))
    if named:
        schedule, first, rate = _RUNS[named[0]]
        if "calibrated" in words:
            schedule = schedule | {"rule": "calibrated"}
        return ramp_run(size, schedule, base_batch_size=first, learning_rate=rate)
    c = digits_sweep.get_config(size)
    c.ramps = [  # each: label, schedule, learning_rate ("best@B" or η_0), lr_coupling
        fixed(16), fixed(256),
        _ramp("step (Llama 3)", STEP, 32),
        _ramp("linear (DeepSeek-V3)", LINEAR, 32),
        _ramp("adaptive", ADAPTIVE, 16) | {"adapt_every": 10},
    ]
    if "tiny" in words:  # thresholds within the tiny budget (~600 examples); every ramp
        #   starts at B = 8, a batch size of the tiny sweep (8, 32, 128)
        step = {"kind": "step", "steps": ((0, 8), (128, 16), (384, 32))}
        adaptive = ADAPTIVE | {"min_batch": 8, "initial": 8, "multiple": 8}
        small = {"micro_batch": 8}
        c.ramps = [fixed(32),
                   _ramp("step", STEP, 8) | {"schedule": step} | small,
                   _ramp("adaptive", ADAPTIVE, 8) | {"schedule": adaptive,
                                                    "adapt_every": 5} | small]
    return c
