"""Kaplan et al. (2020) §5 at laptop scale: B_crit(L) of a character-level Transformer LM.

    cbs-sweep --config=shakespeare_kaplan --sweep_dir=results/shakespeare_kaplan
    cbs-sweep --config=shakespeare_kaplan:tiny \
        --sweep_dir=/tmp/kaplan_tiny   # seconds: the whole pipeline, meaningless numbers

The model and data of `shakespeare_sweep`, set up so that the fit supports a claim within
about an hour on 2 CPU cores: targets past the initial transient; batch sizes bracketing every
fitted B_crit (23 to 80) by at least 4× on both sides. The report gives B_crit(L) in sequences
and tokens beside Kaplan's α_B ≈ 0.21 and B* ≈ 2·10⁸ tokens (per BPE token of WebText2: α_B,
the trend's shape, is comparable; B* is not). Committed: results/shakespeare_kaplan/ (68
trials, 68 minutes on 2 shared CPU cores).

Held out from the advice's calibration: `depth4` (4 blocks instead of 2), with `predict` for
the one run the advice is made from (B = 32, the grid's centre rate):

    cbs-sweep --config=shakespeare_kaplan:depth4,predict \
        --sweep_dir=results/heldout_lm_depth4_predict
    cbs-advise --sweep_dir=results/heldout_lm_depth4_predict

Across sizes: `d32` or `d128` changes only the width, e.g.

    cbs-sweep --config=shakespeare_kaplan:d32 --sweep_dir=results/shakespeare_kaplan_d32
"""

from __future__ import annotations

from cbs.configs import base, shakespeare_sweep

__all__ = ["get_config"]

# Widths of the across-sizes study (Kaplan et al. 2020, Fig. 10) beside the default D = 64.
WIDTHS = {"d32": 32, "d128": 128}


def get_config(arg: str = ""):
    words = base.parse_arg(arg, known=("tiny", "depth4", "predict", *WIDTHS))
    c = shakespeare_sweep.get_config("tiny" if "tiny" in words else "")
    for word, width in WIDTHS.items():
        if word in words:
            c.model.d_model, c.model.d_ff = width, 4 * width  # 4 heads, d_ff = 4D
    if "depth4" in words:  # a held-out task for the batch-size advice: twice as deep
        c.model.num_layers = 4  # blocks (the committed studies have 2)
    s = c.sweep
    s.batch_sizes = tuple(2 ** k for k in range(2, 10))  # 4 ... 512 sequences of 32 chars
    s.base_lr = 3e-3  # η at B = 64, centre of the grid
    s.lr_factors = (0.5, 1.0, 2.0)  # factor-2 grid around the square-root rule
    s.max_lr = 0.03  # cap on any rate (AdamW with clipping)
    s.extend_lr_rounds = 4  # factor-2 steps past an edge optimum, one per round
    s.seeds = (0, 1)  # two seeds per (B, η): the fit uses their mean steps
    s.targets = (2.5, 2.4, 2.3, 2.2, 2.1)  # eval loss, nats per character, past the transient
    s.max_examples = 100_000  # sequences per trial
    s.max_steps = 6_000  # updates per trial
    s.evals_per_trial = 40  # log-spaced evaluations (a factor 1.25 in steps apart at 6,000)
    n = c.noise  # measured at each evaluation, on a fresh stream (shakespeare_sweep's)
    n.batch_size = 128  # windows per B_simple measurement (a large batch)
    n.curvature = True  # B_noise too
    n.deviations = 16  # of those, windows whose deviations give tr(HΣ)
    n.hessian_batch_size = 16  # independent windows whose Hessian gives tr(HΣ), GᵀHG
    if "d128" in words:  # B = 8 ... 512: B = 4 costs the most steps, and the fitted B_crit
        s.batch_sizes = s.batch_sizes[1:]  # of D = 32 and 64 (≥ 20) stay 2.5× above B = 8
    if "tiny" in words:
        s.batch_sizes = (8, 16, 32)  # three batch sizes
        s.lr_factors = (1.0, 2.0)  # two rates each
        s.extend_lr_rounds = 1  # one round past an edge
        s.targets = (4.2, 4.0, 3.8)  # loose targets
        s.max_steps, s.max_examples = 12, 0  # a few steps
        s.evals_per_trial = 4  # four evaluations
        n.batch_size = 16  # small measurements
        n.curvature = False  # no curvature (its compilation dominates)
    if "predict" in words:  # ONE run for the advice (cbs-advise --sweep_dir), before a sweep
        s.batch_sizes = (32,)  # one batch size
        s.lr_factors = (1.0,)  # one rate: the grid's centre
        s.seeds = (0,)  # one seed
        s.extend_lr_rounds = 0  # no extension (one run)
    return c
