"""The payoff of measuring on digits: ramps against fixed batch sizes, three seeds each.

    python -m experiments.ramps --config=experiments/configs/digits_payoff.py \
        --sweep_dir=results/digits --out_dir=results/digits_payoff

Reads the main job's sweep (results/digits: learning rates) and the local-CBS study
(results/digits_branch: the schedule of the "local CBS" ramp) and writes only to out_dir.
Every run below is repeated over seeds 0, 1, 2 and stopped once the full training loss
crossed every target; `cbs.analysis.payoff` fits the frontier to the fixed batch sizes and
reports each ramp's step saving at equal examples with a bootstrap interval over seeds
(payoff.md). Runs:

- fixed B = 16 … 256 at the sweep's best learning rate at B (the frontier);
- "adaptive (B_simple)": B follows the live noise scale (`ramp_adaptive.py`);
- "local CBS": a step schedule through the branched study's local critical batch B*(e)
  (`cbs.analysis.branch_report.local_cbs_schedule`), 8 → 16 → 32;
- the Llama 3 and DeepSeek-V3 shapes (`ramp_llama3_style.py`, `ramp_deepseek_style.py`).
"""

from __future__ import annotations

import os

from cbs.analysis import branch_report
from cbs.configs import base, digits_ramps

__all__ = [
    "BRANCH_DIR", "FIXED", "SEEDS", "get_config", "local_cbs_ramp",
]

SEEDS = (0, 1, 2)
FIXED = (16, 32, 64, 128, 256)
BRANCH_DIR = "results/digits_branch"  # the local-CBS study this config reads


def local_cbs_ramp(branch_dir: str, micro_batch: int) -> dict:
    """A ramp through a branched study's B*(examples), from the sweep's best rate at its
    first B, square-root coupled."""
    schedule = branch_report.local_cbs_schedule(branch_dir, multiple=micro_batch)
    first = schedule["steps"][0][1]
    return {"label": "local CBS", "micro_batch": micro_batch, "schedule": schedule,
            "learning_rate": f"best@{first}",
            "lr_coupling": {"rule": "sqrt", "base_batch_size": first, "cap": 0.03}}


def get_config(arg: str = ""):
    words = base.parse_arg(arg)
    c = digits_ramps.get_config(arg)
    if "tiny" in words:  # the tiny sweep's batch sizes; two seeds; no branch study needed
        runs = [digits_ramps.fixed(b) for b in (8, 32, 128)] + [
            r for r in c.ramps if not r["label"].startswith("fixed")]
        c.ramps = base.seeded(runs, (0, 1))
        return c
    ramps = {r["label"]: r for r in c.ramps}
    runs = [digits_ramps.fixed(b) for b in FIXED] + [
        ramps["adaptive"] | {"label": "adaptive (B_simple)"},
        local_cbs_ramp(os.path.join(base.repo_root(), BRANCH_DIR), 8),
        ramps["step (Llama 3)"], ramps["linear (DeepSeek-V3)"]]
    c.ramps = base.seeded(runs, SEEDS)
    return c
