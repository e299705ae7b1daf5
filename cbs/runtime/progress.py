"""Progress of a run (`cbs.engine.loop.Loop`, `cbs.sweeps.groups`): the loss EMA, the divergence
rule, the evaluation schedule.

Divergence (one rule for every run): a run has diverged at the first observation that is
non-finite, or that ends a streak of `patience` consecutive observations above `factor` × the
initial (first finite) observation; a shorter spike is not a divergence. `factor = 0` keeps
only the non-finite test.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["DivergenceRule", "DivergenceState", "ema_curve", "ema_update", "log_spaced_steps"]


def ema_update(ema: Any, value: Any, decay: float) -> Any:
    """One step of the loss EMA: `value` when `ema` is NaN (nothing seen yet), else
    decay·ema + (1 − decay)·value. Works on Python floats, NumPy and JAX arrays (traceable)."""
    if isinstance(ema, float | int) and isinstance(value, float | int):
        return float(value) if math.isnan(ema) else decay * ema + (1 - decay) * value
    host = (np.ndarray, np.generic, float, int)
    xp = np if all(isinstance(x, host) for x in (ema, value)) else jnp
    return xp.where(xp.isnan(ema), value, decay * ema + (1 - decay) * value)


def ema_curve(values: Sequence[float], decay: float) -> list[float]:
    """The loss EMA after each of `values` in turn (`ema_update` from NaN), as floats."""
    steps = itertools.accumulate(values, lambda ema, v: ema_update(ema, float(v), decay),
                                 initial=math.nan)
    return list(steps)[1:]


@dataclasses.dataclass(frozen=True)
class DivergenceState:
    """What the rule remembers between observations (JSON-serialisable, for checkpoints):
    initial, the first finite observation (NaN before it); streak, consecutive observations
    above the threshold, the first at index streak_start (-1: none); seen, observations so
    far; diverged_at, the index of the divergence (-1: none) and its reason in words."""

    initial: float = math.nan
    streak: int = 0
    streak_start: int = -1
    seen: int = 0
    diverged_at: int = -1
    reason: str = ""

    @property
    def diverged(self) -> bool:
        return self.diverged_at >= 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["initial"] = None if math.isnan(self.initial) else self.initial
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> DivergenceState:
        if not d:
            return cls()
        d = dict(d)
        d["initial"] = math.nan if d.get("initial") is None else float(d["initial"])
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class DivergenceRule:
    """The divergence rule (module docstring) over a run's progress losses in order: each step's
    batch loss of a single run, each evaluation's progress metric of a sweep trial."""

    factor: float = 0.0
    patience: int = 1

    def __post_init__(self):
        if self.factor < 0 or (0 < self.factor <= 1):
            raise ValueError(f"divergence_factor must be 0 (off) or > 1, got {self.factor}")
        if self.patience < 1:
            raise ValueError(f"divergence_patience must be >= 1, got {self.patience}")

    def update(self, state: DivergenceState, value: float) -> DivergenceState:
        """The state after one more observation (no change once diverged)."""
        if state.diverged:
            return state
        i, value = state.seen, float(value)
        if not math.isfinite(value):
            return dataclasses.replace(state, seen=i + 1, diverged_at=i,
                                       reason=f"non-finite loss {value}")
        initial = value if math.isnan(state.initial) else state.initial
        if self.factor and value > self.factor * initial:
            streak, start = state.streak + 1, state.streak_start if state.streak else i
        else:
            streak, start = 0, -1
        new = DivergenceState(initial, streak, start, i + 1)
        if streak >= self.patience:
            reason = (f"loss above {self.factor:g} × the initial {initial:.4g} for {streak} "
                      f"consecutive observations (now {value:.4g})")
            new = dataclasses.replace(new, diverged_at=i, reason=reason)
        return new

    def scan(self, values: Sequence[float] | np.ndarray, state: DivergenceState | None = None
             ) -> DivergenceState:
        """The state after observing `values` in order (stops at a divergence)."""
        state = DivergenceState() if state is None else state
        for v in values:
            state = self.update(state, v)
            if state.diverged:
                break
        return state

    def first_bad(self, values: Sequence[float] | np.ndarray) -> int | None:
        """Index where the divergence began (the streak's first observation, or the
        non-finite one), or None: the observations before it are the usable curve."""
        state = self.scan(values)
        if not state.diverged:
            return None
        return state.streak_start if state.streak >= self.patience else state.diverged_at


def log_spaced_steps(budget: int, points: int) -> list[int]:
    """0, then `points` steps spaced evenly in log(step) up to `budget` (deduplicated), and
    the budget itself: the relative resolution of a crossing is the same early and late."""
    grid = np.geomspace(1, budget, int(points))
    return [0] + sorted({int(round(x)) for x in grid} | {int(budget)})
