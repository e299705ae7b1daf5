"""The sweep grid: one trial per (batch size B, learning rate η, seed), declared in
`config.sweep` (`default_sweep_config`) beside the base run, and its sharding over launchers.

The rate grid is absolute (`sweep.learning_rates`) or centred on a rule: η(B) = base_lr ·
(B / base_batch_size)^p · factor, p = 1 (linear), 1/2 (sqrt) or 0. When the best rate for a
target sits at an edge of its grid, `grid_trials` adds factor-2 rates past it
(`sweep.extend_lr_count` per round, up to `sweep.extend_lr_rounds` rounds, within
`sweep.min_lr`/`sweep.max_lr`; the rule: `cbs.analysis.fits.edges`). Trials:
`cbs.sweeps.trials`; the sweep directory: `cbs.results.store`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import ml_collections
from ml_collections.config_dict import placeholder

from cbs.analysis.fits import edges
from cbs.engine.lr import LR_RULES, lr_multiplier
from cbs.engine.noise_spec import check_moved_keys
from cbs.runtime import fields
from cbs.runtime.fields import ConfigError

__all__ = [
    "Trial", "default_sweep_config", "grid_trials", "learning_rates_for", "make_trials",
    "parse_shard", "shard_trials", "trial_table", "validate_sweep",
]

TARGET_METRICS = ("full_train/loss", "eval/loss", "train/loss_ema")


def default_sweep_config() -> ml_collections.ConfigDict:
    """The sweep fields, with their meaning and units."""
    s = ml_collections.ConfigDict()
    s.batch_sizes = (8, 32, 128, 512)  # global batch sizes B to try (examples per step)
    s.learning_rates = ()  # absolute learning rates; when empty, the rule below is used
    s.base_lr = 1e-3  # learning rate at base_batch_size, centre of the grid
    s.base_batch_size = 64  # batch size at which base_lr is right (examples)
    s.lr_rule = "sqrt"  # how the grid centre moves with B: "none", "sqrt" or "linear"
    s.lr_factors = (0.5, 1.0, 2.0)  # multiplicative grid around the centre (factor 2)
    s.max_lr = 0.0  # cap on any learning rate in the grid and its extensions (0 = no cap)
    s.min_lr = 0.0  # floor on the learning rates added below the grid (0 = none)
    s.extend_lr_rounds = 0  # rounds of factor-2 rates added past an edge best rate (0 = off)
    s.extend_lr_count = 1  # rates added past an edge per round (each a factor 2 further)
    s.seeds = (0,)  # training seeds (init and data order) per (B, lr)
    s.targets = (0.5, 0.2, 0.1)  # target values of the progress metric (loss, nats)
    s.target_metric = "full_train/loss"  # "full_train/loss", "eval/loss" or "train/loss_ema"
    s.loss_ema_decay = 0.9  # smoothing of the batch loss when target_metric="train/loss_ema"
    s.max_examples = 2_000_000  # budget per trial in examples (E); 0 = no limit
    s.max_steps = 5_000  # budget per trial in optimizer steps (S); 0 = no limit
    s.evals_per_trial = 120  # progress evaluations over a trial's step budget (log-spaced)
    s.noise_window = 5  # evaluations averaged around a crossing for the measured noise scale
    s.divergence_factor = 4.0  # a loss above factor × initial loss counts as diverged (0 = off)
    s.divergence_patience = 3  # ... when it stays above for this many consecutive evaluations
    s.vmap_trials = True  # run the learning rates of one (B, seed) as one vmapped program
    s.noise_protocol = "per_trial"  # "per_trial": noise at each best trial's crossings only;
    #   "reference": also a rerun at noise_reference_batch_size measured on all examples
    s.noise_reference_batch_size = 64  # B_ref of the reference trajectory (a swept batch size)
    s.noise_reference_evals = 200  # evaluations of the reference run (log-spaced, to its budget)
    s.reference_noise = ml_collections.ConfigDict(  # fields of config.noise replaced for
        {"deviations": placeholder(int)})  # the reference run (None: the run's; more: steadier)
    s.checkpoint_every_evals = 20  # vmapped groups: evaluations between checkpoints
    s.stop_when_dominated = True  # vmapped groups: stop once one rate reached every target
    #   (the others cannot be fastest; off when averaging several seeds per rate)
    return s


def default_sweep_noise(noise: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Writes into `config.noise` the measurement a sweep makes at each evaluation unless its
    config says otherwise (`cbs.engine.noise_spec.NoiseSpec`); returns the section."""
    noise.examples = "stream"  # a fresh stream at each evaluation ("all": the training set)
    noise.batch_size = 256  # n, examples per measurement (0 = off)
    noise.curvature = True  # B_noise too
    noise.deviations = 64  # m, of those, examples whose deviations give tr(HΣ)
    noise.hessian_batch_size = 64  # h, examples, drawn independently, whose Hessian H is used
    noise.chunk_size = 64  # examples per vmap chunk of the exact measurement (memory)
    return noise


@dataclasses.dataclass(frozen=True)
class Trial:
    """One point of the sweep grid."""

    index: int
    batch_size: int
    learning_rate: float
    seed: int

    @property
    def trial_id(self) -> str:
        return f"b{self.batch_size:06d}_lr{self.learning_rate:.4e}_s{self.seed}"


# The type and least value of each field (`cbs.runtime.fields.check_section`).
_INTEGER_FIELDS = {
    "base_batch_size": 1, "extend_lr_rounds": 0, "extend_lr_count": 1, "max_examples": 0,
    "max_steps": 0, "evals_per_trial": 2, "noise_window": 1, "divergence_patience": 1,
    "noise_reference_batch_size": 1, "noise_reference_evals": 2, "checkpoint_every_evals": 1,
}
_NUMBER_FIELDS = ("base_lr", "max_lr", "min_lr", "divergence_factor", "loss_ema_decay")
_SWITCH_FIELDS = ("vmap_trials", "stop_when_dominated")
_LIST_FIELDS = {"batch_sizes": ("examples per step", True, 0, True),
                "learning_rates": ("empty: the lr_rule grid", False, 0, True),
                "lr_factors": ("factors around the grid centre", False, 0, True),
                "seeds": ("training seeds", True, 0, False)}


def validate_sweep(sweep: ml_collections.ConfigDict) -> None:
    """Raises `ConfigError` naming the field of an invalid sweep definition."""
    def fail(field: str, why: str) -> None:
        raise ConfigError(f"config.sweep.{field}: {why}")

    check_moved_keys(sweep, "sweep")
    targets = (f"losses: {sweep.get('target_metric')} is never below 0", False, 0, True)
    fields.check_section(sweep, "config.sweep", integers=_INTEGER_FIELDS,
                         finite_fields=_NUMBER_FIELDS, switches=_SWITCH_FIELDS,
                         lists=_LIST_FIELDS | {"targets": targets})
    if not sweep.batch_sizes:
        fail("batch_sizes", "needs at least one batch size")
    if len(set(sweep.batch_sizes)) != len(sweep.batch_sizes):
        fail("batch_sizes", f"has duplicates: {tuple(sweep.batch_sizes)}")
    if not sweep.learning_rates:
        if sweep.lr_rule not in LR_RULES:
            fail("lr_rule", f"must be one of {list(LR_RULES)}, got {sweep.lr_rule!r}")
        if not sweep.base_lr > 0:
            fail("base_lr", f"must be positive, got {sweep.base_lr}")
        if not sweep.lr_factors:
            fail("lr_factors", "needs at least one factor (or give learning_rates)")
    if not sweep.seeds:
        fail("seeds", "needs at least one seed")
    if not sweep.targets:
        fail("targets", "needs at least one target loss")
    if sweep.target_metric not in TARGET_METRICS:
        fail("target_metric", f"must be one of {TARGET_METRICS}, got {sweep.target_metric!r}")
    if not 0 <= sweep.get("loss_ema_decay", 0.0) < 1:
        fail("loss_ema_decay", f"must be in [0, 1), got {sweep.loss_ema_decay}")
    if sweep.max_examples == 0 and sweep.max_steps == 0:
        fail("max_steps", "set max_steps or max_examples: a trial needs a budget")
    if sweep.divergence_factor < 0 or 0 < sweep.divergence_factor <= 1:
        fail("divergence_factor", f"must be 0 (off) or > 1, got {sweep.divergence_factor}")
    protocol = sweep.get("noise_protocol", "per_trial")
    if protocol not in ("per_trial", "reference"):
        fail("noise_protocol", f"must be 'per_trial' or 'reference', got {protocol!r}")
    if protocol == "reference" and (
            sweep.noise_reference_batch_size not in tuple(sweep.batch_sizes)):
        fail("noise_reference_batch_size", f"{sweep.noise_reference_batch_size} is not one of "
             f"the swept batch sizes {tuple(sweep.batch_sizes)}")
    if sweep.max_lr < 0 or sweep.min_lr < 0:
        fail("max_lr", "learning-rate cap and floor must be >= 0 (0 = none)")
    if sweep.max_lr and sweep.min_lr > sweep.max_lr:
        fail("min_lr", f"is above max_lr ({sweep.min_lr} > {sweep.max_lr})")


def learning_rates_for(sweep: ml_collections.ConfigDict, batch_size: int) -> list[float]:
    """The learning-rate grid at one batch size (absolute, or centred on the scaling rule)."""
    if sweep.learning_rates:
        lrs = [float(lr) for lr in sweep.learning_rates]
    else:
        centre = sweep.base_lr * lr_multiplier(batch_size, sweep.base_batch_size, sweep.lr_rule)
        lrs = [centre * f for f in sweep.lr_factors]
    if sweep.max_lr:
        lrs = sorted({min(lr, sweep.max_lr) for lr in lrs})
    return lrs


def make_trials(sweep: ml_collections.ConfigDict) -> list[Trial]:
    """The full grid in a fixed order: batch size, then seed, then learning rate."""
    validate_sweep(sweep)
    points = [(b, lr, int(seed)) for b in sorted(int(b) for b in sweep.batch_sizes)
              for seed in sweep.seeds for lr in learning_rates_for(sweep, b)]
    return [Trial(i, *point) for i, point in enumerate(points)]


def trial_table(trials: Sequence[Trial]) -> list[dict[str, Any]]:
    """The trials as JSON-ready dicts (sweep.json's "trials": the base grid)."""
    return [dataclasses.asdict(t) | {"trial_id": t.trial_id} for t in trials]


def grid_trials(sweep: ml_collections.ConfigDict, records: Sequence[dict[str, Any]]
                ) -> list[Trial]:
    """The base grid plus the rates added past edges (`cbs.analysis.fits.edges`); an added
    trial's index is fixed by its (B, seed, side, step past the grid), whatever the order of
    rounds, so shards and reruns agree on it. Records of trials outside the grid are ignored."""
    base = make_trials(sweep)
    if not sweep.extend_lr_rounds:
        return base
    sweep_dict = sweep.to_dict()
    steps = int(edges.extension_rules(sweep_dict)["steps"])
    state = edges.sweep_grid(trial_table(base), records, sweep_dict)
    seeds = [int(s) for s in sweep.seeds]
    out = list(base)
    for ib, b in enumerate(sorted(state)):
        at_b = state[b]
        for lr in at_b["lrs"]:
            side, k = edges.step_of(lr, at_b["base_lrs"])
            if side == "base":
                continue
            slot = k - 1 if side == edges.HIGH else steps + k - 1
            for js, seed in enumerate(seeds):
                index = len(base) + (ib * len(seeds) + js) * 2 * steps + slot
                out.append(Trial(index, b, lr, seed))
    return sorted(out, key=lambda t: t.index)


def parse_shard(shard: str | None) -> tuple[int, int]:
    """'i/n' -> (i, n); None -> (0, 1). Raises ValueError naming --shard."""
    if not shard:
        return 0, 1
    try:
        i, n = (int(v) for v in shard.split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like i/n (e.g. 0/4), got {shard!r}") from None
    if n <= 0 or not 0 <= i < n:
        raise ValueError(f"--shard={shard}: need 0 <= i < n")
    return i, n


def shard_trials(trials: Sequence[Trial], shard: str | None,
                 batch_sizes: Sequence[int]) -> list[Trial]:
    """Shard i of n owns the batch sizes whose rank in sorted `batch_sizes` is ≡ i (mod n),
    with every seed and rate at them (each group runs whole; a shard extends its own rates)."""
    i, n = parse_shard(shard)
    rank = {int(b): k for k, b in enumerate(sorted(int(b) for b in batch_sizes))}
    return [t for t in trials if rank[int(t.batch_size)] % n == i]
