"""The payoff of measuring on the character LM: ramps against fixed batch sizes, 3 seeds each.

    cbs-ramps --config=shakespeare_payoff \
        --sweep_dir=results/shakespeare_char --out_dir=results/shakespeare_payoff

The model, data and targets of `shakespeare_sweep`; learning rates from its committed sweep
(results/shakespeare_char), the local-CBS schedule from its branched study
(results/shakespeare_branch); writes only to out_dir. `cbs.analysis.studies.payoff` reports
seed intervals and each ramp's step saving at equal examples against the fixed batch sizes'
frontier; "local CBS" runs the branched study's B*(examples), 32 → 256 at 30,400 sequences.
"""

from __future__ import annotations

import os

from cbs.configs import base, digits_payoff, digits_ramps, shakespeare_sweep

__all__ = ["BRANCH_DIR", "FIXED", "SEEDS", "get_config"]

SEEDS = (0, 1, 2)
FIXED = (8, 16, 32, 64, 128)
BRANCH_DIR = "results/shakespeare_branch"


def get_config(arg: str = ""):
    words = base.parse_arg(arg)
    c = shakespeare_sweep.get_config(arg)
    adaptive = digits_ramps.ADAPTIVE | {"min_batch": 8, "max_batch": 256, "initial": 8,
                                         "multiple": 8}
    runs = [digits_ramps.fixed(b) for b in FIXED] + [
        {"label": "adaptive (B_simple)", "micro_batch": 8, "schedule": adaptive,
         "learning_rate": "best@8", "adapt_every": 10,
         "lr_coupling": {"rule": "sqrt", "base_batch_size": 8, "cap": c.sweep.max_lr}}]
    if "tiny" in words:  # the tiny sweep's batch sizes (8, 32): no frontier, a smoke run
        c.ramps = base.seeded([digits_ramps.fixed(8), runs[-1]], (0,))
        return c
    runs.append(digits_payoff.local_cbs_ramp(os.path.join(base.repo_root(), BRANCH_DIR), 16)
                | {"lr_coupling": {"rule": "sqrt", "base_batch_size": 32,
                                   "cap": c.sweep.max_lr}})
    c.ramps = base.seeded(runs, SEEDS)
    return c
