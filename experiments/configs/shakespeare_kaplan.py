"""Kaplan et al. (2020) §5 at laptop scale: B_crit(L) of a character-level Transformer LM.

    python -m experiments.sweep --config=experiments/configs/shakespeare_kaplan.py \
        --sweep_dir=results/shakespeare_kaplan
    python -m experiments.sweep --config=experiments/configs/shakespeare_kaplan.py:tiny \
        --sweep_dir=/tmp/kaplan_tiny   # seconds: the whole pipeline, meaningless numbers

The model and data of `shakespeare_sweep` (2 layers, D = 64, windows of T = 32 characters,
AdamW at a constant rate), set up so that the fit supports a claim:

- targets 2.4 to 1.9 nats per character on the evaluation windows, past the initial
  transient (the loss falls from ln 80 ≈ 4.4 to ≈ 2.5 within the first few hundred steps at
  any batch size, where S barely depends on B);
- batch sizes 4 to 2048 sequences (128 to 65,536 tokens): the previous study's B_crit of
  40–70 sequences at L = 2.4–2.2 is bracketed by 8× below and 30× above, room for B_crit
  to grow at lower loss;
- a factor-2 learning-rate grid on the square-root rule, extended by up to three factor-2
  steps past any edge optimum (`sweep.extend_lr_rounds`), capped at 0.03;
- two seeds per (B, η): the fit uses their mean steps, the report's figures their spread;
- B_simple measured on 512 fresh windows at every evaluation, B_noise on 32 of them.

The report (report.md) gives B_crit(L) in sequences and in tokens beside Kaplan's
α_B ≈ 0.21 and B* ≈ 2·10⁸ tokens (their loss is nats per BPE token of WebText2, ours nats per
character of Shakespeare: α_B, the shape of the trend, is the comparable number; B* is not).
Not yet run: the budget (≤ 200,000 sequences per trial, 9 batch sizes × ~4 rates × 2 seeds)
is several CPU-hours on 2 cores; run it on a machine of its own.
"""

from __future__ import annotations

from experiments.configs import base, shakespeare_sweep


def get_config(arg: str = ""):
    words = base.parse_arg(arg)
    c = shakespeare_sweep.get_config("tiny" if "tiny" in words else "")
    s = c.sweep
    s.batch_sizes = tuple(2 ** k for k in range(2, 10))  # 4 ... 512 sequences of 32 chars
    s.base_lr = 3e-3  # η at B = 64, centre of the grid
    s.lr_factors = (0.5, 1.0, 2.0)  # factor-2 grid around the square-root rule
    s.max_lr = 0.03  # cap on any rate (AdamW with clipping)
    s.extend_lr_rounds = 2  # factor-2 steps past an edge optimum, one per round
    s.seeds = (0, 1)  # two seeds per (B, η): the fit uses their mean steps
    s.stop_when_dominated = True  # a group stops once its best rate reached every target
    s.targets = (2.5, 2.4, 2.3, 2.2, 2.1)  # eval loss, nats per character, past the transient
    s.max_examples = 100_000  # sequences per trial
    s.max_steps = 6_000  # updates per trial
    s.evals_per_trial = 40  # log-spaced evaluations (a factor 1.25 in steps apart at 6,000)
    s.noise_batch_size = 128  # windows per B_simple measurement (a large batch)
    s.noise_curvature_batch_size = 16  # of those, windows whose deviations give tr(HΣ)
    s.noise_hessian_batch_size = 16  # independent windows whose Hessian gives tr(HΣ), GᵀHG
    if "tiny" in words:
        s.batch_sizes = (8, 16, 32)  # three batch sizes
        s.lr_factors = (1.0, 2.0)  # two rates each
        s.extend_lr_rounds = 1  # one round past an edge
        s.targets = (4.2, 4.0, 3.8)  # loose targets
        s.max_steps, s.max_examples = 12, 0  # a few steps
        s.evals_per_trial = 4  # four evaluations
        s.noise_batch_size = 16  # small measurements
        s.noise_curvature_batch_size = 4  # tiny curvature measurement
        s.noise_hessian_batch_size = 4  # tiny Hessian batch
    return c
