"""The config of a branch study (`config.branch`, `cbs.sweeps.branches`): its fields with the
paper's defaults, their validation, and the numbers derived from them. Letters: B the
reference run's batch, k a batch multiplier, Δ the window in examples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NoReturn

import ml_collections

from cbs.engine import spec
from cbs.engine.lr import EXPONENTS, lr_multiplier
from cbs.engine.noise_spec import NoiseSpec, check_moved_keys
from cbs.runtime import fields
from cbs.runtime.fields import ConfigError

__all__ = [
    "BRANCH_LR_RULES", "CRITERIA", "default_branch_config", "ema_decay_per_step", "lr_factor",
    "reference_batch", "reference_run_config", "validate_branch_config", "window_examples",
]

# The rules f(k) = k^p of `cbs.engine.lr.LR_RULES` that grow with k (p > 0).
BRANCH_LR_RULES = tuple(r for r, p in EXPONENTS.items() if p > 0)
METRICS = ("loss_ema", "full_train/loss")
EMA_UNITS = ("step", "reference_batch")
CRITERIA = ("paper", "ladder")
B_STAR_RULES = ("k_star", "geometric")
# Δ of the paper (2B tokens ≈ 477 OLMo steps, Sec. 3.1) in steps, up to a power of two.
PAPER_WINDOW_STEPS = 512


def default_branch_config() -> ml_collections.ConfigDict:
    """`config.branch`, the paper's choices as defaults (Merrill et al. 2025, Sec. 3.1); the k
    ladder, `window_fraction` and the reference-noise fields (off by default) are ours."""
    b = ml_collections.ConfigDict()
    b.points_examples = ()  # branch at the last checkpoint at or before these examples seen
    b.points_losses = ()  # ... and where the reference's smoothed train loss first falls to these
    b.ks = (1, 2, 4, 8, 16, 32)  # batch multipliers k (branch batch k·B); must start at 1
    b.lr_rule = "sqrt"  # f(k): "sqrt" η = √k·η_0 (Adam, the paper's), "linear" η = k·η_0 (SGD)
    b.window_examples = 0  # Δ, examples per branch; 0 = 512·B (≈ the paper's 2B tokens)
    b.window_fraction = 0.0  # > 0: Δ = this fraction of the examples seen at the point
    b.epsilon = 0.01  # ε: k passes if its loss ≤ min over smaller k + ε (paper: 0.01 nats)
    b.tolerance = "absolute"  # ε in nats ("absolute", paper) or a fraction of that min ("relative")
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
    b.noise_checkpoints = 0  # > 0: exact B_simple, B_noise on the whole training set at every
    #   branch point and this many log-spaced reference checkpoints (in-memory data); 0 = off
    b.noise = ml_collections.ConfigDict({  # that measurement: fields of config.noise
        "method": "sampled", "examples": "all",  # per-example gradients of all N, H over N
        "curvature": True, "deviations": 256,  # m, examples whose deviations give tr(HΣ)
        "chunk_size": 64})  # examples per vmap chunk (memory)
    b.noise_seed = 0  # draw of those m examples
    return b


def validate_branch_config(config: ml_collections.ConfigDict) -> None:
    """Raises `ConfigError` naming the `config.branch.*` (or engine) field to change."""
    b = config.branch

    def fail(field: str, problem: str) -> NoReturn:
        raise ConfigError(f"config.{field}: {problem}")

    check_moved_keys(b, "branch")
    fields.check_section(b, "config.branch", integers=_INTEGERS, finite_fields=_FINITE,
                         switches=("vmap",), lists=_LISTS)
    if b.noise_checkpoints:
        m = NoiseSpec.of(config, "branch").deviations
        if m < 1:
            fail("branch.noise.deviations", f"must be an integer >= 1, got {m}")
    ks = [int(k) for k in b.ks]
    if not ks or ks[0] != 1 or any(y <= x for x, y in zip(ks, ks[1:], strict=False)):
        fail("branch.ks", f"give increasing multipliers starting at 1, got {tuple(b.ks)}")
    if b.lr_rule not in BRANCH_LR_RULES:
        fail("branch.lr_rule", f"use one of {sorted(BRANCH_LR_RULES)}, got {b.lr_rule!r}")
    if b.tolerance not in ("absolute", "relative"):
        fail("branch.tolerance", f"must be 'absolute' or 'relative', got {b.tolerance!r}")
    if not b.epsilon > 0:
        fail("branch.epsilon", f"must be > 0, got {b.epsilon}")
    for field, known in (("metric", METRICS), ("loss_ema_per", EMA_UNITS),
                         ("criterion", CRITERIA), ("b_star", B_STAR_RULES)):
        if b.get(field, known[0]) not in known:
            fail(f"branch.{field}", f"use one of {known}, got {b[field]!r}")
    if not 0 <= b.loss_ema_decay < 1:
        fail("branch.loss_ema_decay", f"must be in [0, 1), got {b.loss_ema_decay}")
    if not 0 <= float(b.get("window_fraction", 0.0)) <= 1:
        fail("branch.window_fraction", f"must be in [0, 1], got {b.window_fraction}")
    if not b.seeds:
        fail("branch.seeds", "give at least one data-order seed")
    if not (b.points_examples or b.points_losses):
        fail("branch.points_examples", "give branch points (or branch.points_losses)")
    for field, value, wanted in (("batch.schedule.kind", config.batch.schedule.kind, "constant"),
                                 ("batch.lr_coupling.rule", config.batch.lr_coupling.rule, "none")):
        if value != wanted:
            fail(field, f"must be {wanted!r} for the reference run of a branch study, got "
                 f"{value!r}")
    big, unit = window_examples(config), _ladder_lcm(ks) * reference_batch(config)
    if big % unit:
        fail("branch.window_examples", f"{big} must be a multiple of lcm(ks)·B = {unit} (a "
             "whole number of steps for every k)")


# The type and sign of each field (`cbs.runtime.fields.check_section`).
_INTEGERS = {"window_examples": 0, "noise_checkpoints": 0, "noise_seed": 0}
_FINITE = ("window_fraction", "epsilon", "loss_ema_decay")
_LISTS: dict[str, tuple[str, bool, float, bool]] = {
    "ks": ("batch multipliers", True, 1, False),
    "points_examples": ("examples seen", True, 0, False),
    "points_losses": ("smoothed training losses", False, 0, True),
    "seeds": ("data-order seeds", True, 0, False)}


def reference_batch(config: ml_collections.ConfigDict) -> int:
    """B, the reference run's batch size."""
    return int(config.batch.schedule.batch_size)


def _ladder_lcm(ks: Sequence[int]) -> int:
    return math.lcm(*[int(k) for k in ks])


def window_examples(config: ml_collections.ConfigDict, examples_seen: int | None = None) -> int:
    """Δ in examples: `branch.window_fraction` of `examples_seen` (both given), else
    `branch.window_examples`, else PAPER_WINDOW_STEPS·B; a multiple of lcm(ks)·B."""
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
    decay = float(config.branch.loss_ema_decay)
    return decay ** k if config.branch.get("loss_ema_per") == "reference_batch" else decay


def lr_factor(k: int, rule: str) -> float:
    """f(k): k for "linear" (SGD), √k for "sqrt" (Adam)."""
    return float(lr_multiplier(k, 1, rule))


def reference_run_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The base config keeping every checkpoint (branch points need old ones)."""
    return spec.run_config(config, spec.RunOverrides(keep_checkpoints=1_000_000), drop=())
