"""Batch ramps against the digits sweep's frontier: fixed small, fixed large, step, linear and
adaptive batch sizes, each with its learning rate tuned (fixed B) or coupled (ramps).

    cbs-ramps --config=digits_ramps --sweep_dir=runs/digits

Runs the digits sweep first if it is not finished (`digits_sweep.py`, same sweep_dir), then
each ramp below with `cbs.engine.trainer.run`, stopped once the full training loss has crossed every
target; appends them to ramps.jsonl and rewrites the report, whose "Batch-size ramps"
section lists S and E per target and whose figures/ramps_L*.png place each run on that
target's fitted S–E frontier. Fixed runs use the sweep's best learning rate at their B; the
ramps start from the best one at their first B and follow the square-root rule.
"""

from __future__ import annotations

from cbs.configs import (
    base,
    digits_sweep,
    ramp_adaptive,
    ramp_deepseek_style,
    ramp_llama3_style,
)

__all__ = [
    "fixed", "get_config",
]


def fixed(batch_size: int) -> dict:
    return {"label": f"fixed B={batch_size}", "micro_batch": batch_size,
            "schedule": {"kind": "constant", "batch_size": batch_size},
            "learning_rate": f"best@{batch_size}"}


def _ramp(label: str, module, first: int) -> dict:
    return {"label": label, "micro_batch": 16, "schedule": module.SCHEDULE,
            "learning_rate": f"best@{first}",
            "lr_coupling": {"rule": "sqrt", "base_batch_size": first, "cap": 0.03}}


def get_config(arg: str = ""):
    c = digits_sweep.get_config(arg)
    c.ramps = [  # each: label, schedule, learning_rate ("best@B" or η_0), lr_coupling
        fixed(16), fixed(256),
        _ramp("step (Llama 3)", ramp_llama3_style, 32),
        _ramp("linear (DeepSeek-V3)", ramp_deepseek_style, 32),
        _ramp("adaptive", ramp_adaptive, 16) | {"adapt_every": 10},
    ]
    if "tiny" in base.parse_arg(arg):  # thresholds within the tiny budget (~600 examples);
        #   every ramp starts at B = 8, a batch size of the tiny sweep (8, 32, 128)
        step = {"kind": "step", "steps": ((0, 8), (128, 16), (384, 32))}
        adaptive = ramp_adaptive.SCHEDULE | {"min_batch": 8, "initial": 8, "multiple": 8}
        small = {"micro_batch": 8}
        c.ramps = [fixed(32),
                   _ramp("step", ramp_llama3_style, 8) | {"schedule": step} | small,
                   _ramp("adaptive", ramp_adaptive, 8) | {"schedule": adaptive,
                                                          "adapt_every": 5} | small]
    return c
