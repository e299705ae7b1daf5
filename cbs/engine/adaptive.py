"""The adaptive batch-size schedule: B follows the smoothed noise scale the loop feeds it
(`Adaptive`); its state (`AdaptiveState`) is plain numbers, saved with each checkpoint. The
schedule protocol and the registry are `cbs.engine.schedules`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, cast

from cbs.results import calibration

__all__ = ["ADAPTIVE_RULES", "Adaptive", "AdaptiveState"]

ADAPTIVE_RULES = ("multiple", "calibrated")  # values of Adaptive.rule


@dataclasses.dataclass(frozen=True)
class AdaptiveState:
    """Checkpointable state of `Adaptive` (plain ints/floats: `to_dict` is JSON)."""

    batch_size: int
    streak: int = 0  # consecutive updates with the target beyond the band (+ up, − down)
    streak_target: float | None = None  # the streak's least extreme target: what a move trusts
    num_updates: int = 0
    num_changes: int = 0
    last_change_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AdaptiveState:
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """B follows the target clip(k·r·noise_scale, min_batch, max_batch) on the ladder
    min_batch·factor^n, with hysteresis: it moves only after the target has stayed beyond a
    band for `patience` updates. Rule "multiple": r = 1 (McCandlish: B_crit ≈ B_noise, so
    k ≈ 1); rule "calibrated": r = r̂ = `ratio`, the B_crit per unit of B_s that
    `cbs.results.calibration`'s shipped file predicts for the family of `optimizer` (a run
    sets it from `config.optim.name` when None).

    band: a move up needs target > B·band, a move down target < B/band. band > √factor makes
    the dead zones of neighbouring rungs overlap, so a target between two rungs cannot
    flip-flop; the default factor^(3/4) (1.68 for factor 2) leaves a margin of factor^(1/4)
    (19 %) on either side of the geometric midpoint between rungs.
    """

    min_batch: int
    max_batch: int
    initial: int | None = None
    factor: int = 2
    k: float = 1.0
    band: float | None = None
    patience: int = 3
    source: str = "b_simple"  # the smoothed noise scale fed: "b_simple" or "b_noise"
    multiple: int = 1  # micro_batch × data_replicas: every rung a multiple of it
    rule: str = "multiple"
    optimizer: str | None = None

    def __post_init__(self):
        if self.band is None:
            object.__setattr__(self, "band", float(self.factor) ** 0.75)
        if self.factor < 2 or self.min_batch < 1 or self.max_batch < self.min_batch:
            raise ValueError("Adaptive needs factor >= 2 and 1 <= min_batch <= max_batch")
        if self.min_batch % self.multiple:
            raise ValueError(f"min_batch={self.min_batch} must be a multiple of {self.multiple}")
        if cast(float, self.band) ** 2 <= self.factor:
            raise ValueError(f"band={self.band} must exceed sqrt(factor)={self.factor ** 0.5:.3f}"
                             " or a target between two rungs can oscillate")
        if self.patience < 1 or self.k <= 0:
            raise ValueError("Adaptive needs patience >= 1 and k > 0")
        if self.source not in ("b_simple", "b_noise"):
            raise ValueError(f"source must be 'b_simple' or 'b_noise', got {self.source!r}")
        if self.initial is not None and self.initial not in self.rungs:
            raise ValueError(f"initial={self.initial} is not on the ladder {self.rungs}")
        if self.rule not in ADAPTIVE_RULES:
            raise ValueError(f"rule must be one of {ADAPTIVE_RULES}, got {self.rule!r}")
        ratio = None
        if self.rule == "calibrated" and self.optimizer is not None:
            calib = calibration.shipped()
            model = calib["models"].get(self.source)
            if model is None:
                raise ValueError(f"rule='calibrated': the calibration has no {self.source!r} "
                                 f"model (it has {sorted(calib['models'])}); use another "
                                 "source or rule='multiple'")
            try:
                ratio = calibration.predict(model, 1.0, self.optimizer)["ratio"]
            except ValueError as err:
                raise ValueError(f"rule='calibrated': {err}; use rule='multiple'") from None
        object.__setattr__(self, "_ratio", ratio)

    @property
    def ratio(self) -> float:
        """Target B per unit of noise scale over k: 1 ("multiple"), r̂ ("calibrated")."""
        if self.rule == "multiple":
            return 1.0
        if self._ratio is None:  # type: ignore[attr-defined]
            raise ValueError("Adaptive(rule='calibrated') needs its optimizer (a run sets it "
                             "from config.optim.name)")
        return float(self._ratio)  # type: ignore[attr-defined]

    @property
    def rungs(self) -> tuple[int, ...]:
        """Allowed batch sizes: min_batch·factor^n ≤ max_batch."""
        out, b = [], self.min_batch
        while b <= self.max_batch:
            out.append(b)
            b *= self.factor
        return tuple(out)

    @property
    def observes(self) -> str:
        """The noise scale `update` wants: "b_simple" or "b_noise" (`source`)."""
        return self.source

    def batch_sizes(self) -> tuple[int, ...]:
        return self.rungs

    def init(self) -> AdaptiveState:
        return AdaptiveState(batch_size=self.initial or self.min_batch)

    def state_from_dict(self, raw: Mapping[str, Any] | None) -> AdaptiveState:
        """The state saved by `AdaptiveState.to_dict` (a fresh one for None)."""
        return self.init() if raw is None else AdaptiveState.from_dict(raw)

    def batch_size_at(self, examples_seen: float, state: AdaptiveState | None = None) -> int:
        return (state or self.init()).batch_size

    def planning_batch_size(self, examples_seen: float) -> int:
        """The smallest rung: the size a loader can plan for before any observation."""
        return self.min_batch

    def update(self, state: AdaptiveState, noise_scale: float,
               examples_seen: float) -> AdaptiveState:
        """One observation of the smoothed noise scale; returns the next state."""
        noise_scale = float(noise_scale)
        counted = dataclasses.replace(state, num_updates=state.num_updates + 1)
        if not math.isfinite(noise_scale) or noise_scale <= 0:  # EMA not ready: no evidence
            return dataclasses.replace(counted, streak=0, streak_target=None)
        band = cast(float, self.band)  # set in __post_init__
        rungs, b = self.rungs, state.batch_size
        target = min(max(self.k * self.ratio * noise_scale, self.min_batch), self.max_batch)
        up, down = target > b * band and b < rungs[-1], target < b / band and b > rungs[0]
        direction = 1 if up else -1 if down else 0
        if direction == 0:
            return dataclasses.replace(counted, streak=0, streak_target=None)
        if state.streak * direction > 0:  # the streak continues
            streak = state.streak + direction
            pick = min if direction > 0 else max
            trusted = pick(cast(float, state.streak_target), target)  # set in the streak
        else:
            streak, trusted = direction, target
        if abs(streak) < self.patience:
            return dataclasses.replace(counted, streak=streak, streak_target=trusted)
        new_b = min(rungs, key=lambda r: abs(math.log(r / trusted)))
        if (new_b - b) * direction <= 0:  # never stall at the band edge: at least one rung
            new_b = min(r for r in rungs if r > b) if direction > 0 else max(
                r for r in rungs if r < b)
        return dataclasses.replace(counted, batch_size=new_b, streak=0, streak_target=None,
                                   num_changes=state.num_changes + 1,
                                   last_change_at=float(examples_seen))

    @classmethod
    def from_config(cls, c: Mapping[str, Any]) -> Adaptive:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = set(c) - set(names) - {"kind"}
        if unknown:
            raise ValueError(f"batch_schedule: unknown adaptive fields {sorted(unknown)}")
        return cls(**{n: c[n] for n in names if n in c and c[n] is not None})
