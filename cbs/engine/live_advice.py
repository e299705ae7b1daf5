"""The batch-size advice a run logs live, from its live noise estimate at no extra cost.

Each train record with a live noise estimate (`noise/ema_b_simple`) also gets the calibrated
prediction of `cbs.results.calibration` for the optimizer family of `config.optim.name` and
what the record's batch B costs against it (McCandlish et al. 2018, eqs. 2.7 and 2.11), keyed
`advice/<key>` by `ADVICE_KEYS` (their meaning: docs/guides/advice.md, "Live"). The
prediction is log-linear in the noise scale (log B_crit = log B_s + μ̂), so the ratio and the
interval's factors are read once per run and each record costs a few host multiplications.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from cbs.results import calibration, records

__all__ = ["ADVICE_KEYS", "LiveAdvice", "calibration_file"]

ADVICE_KEYS = ("b_crit", "b_crit_lo", "b_crit_hi", "steps_ratio", "examples_ratio")
_SOURCE_KEY = "noise/ema_b_simple"  # the live estimate the advice is computed from
_SCALE = "b_simple"


def calibration_file(path: str) -> dict[str, Any] | None:
    """The calibration file `path` of `config.noise.advice_calibration` (None for "": the
    shipped one)."""
    if not path:
        return None
    calib = records.read_json(path)
    if calib is None:
        raise FileNotFoundError(f"config.noise.advice_calibration: no file {path} (e.g. "
                                "cbs-advise --probe's calibration_STEP.json)")
    return calib


@dataclasses.dataclass(frozen=True)
class LiveAdvice:
    """B_crit and its interval per unit of the live noise scale (None: no advice)."""

    ratio: float | None
    lo: float = math.nan
    hi: float = math.nan

    @classmethod
    def from_config(cls, config: Any, calib: Mapping[str, Any] | None = None) -> LiveAdvice:
        """The advice of `config.optim.name` from `calib` (default: the shipped file); no
        advice when the calibration has no model of B_simple for its optimizer family."""
        calib = calibration.shipped() if calib is None else calib
        model = calib["models"].get(_SCALE)
        try:
            p = calibration.predict(model or {}, 1.0, str(config.optim.name),
                                    level=float(calib["level"]))
        except (ValueError, KeyError):
            return cls(None)
        return cls(p["b_crit"], *p["interval"])

    def record(self, rec: Mapping[str, Any]) -> dict[str, float]:
        """The `advice/*` fields of a train record (empty without a live estimate)."""
        b_s, batch = rec.get(_SOURCE_KEY), rec.get("data/batch_size")
        if self.ratio is None or b_s is None or batch is None or not math.isfinite(b_s):
            return {}
        if not b_s > 0:
            return {f"advice/{k}": math.nan for k in ADVICE_KEYS}
        b_crit = self.ratio * b_s
        t = calibration.tradeoff(float(batch), b_crit)
        values = (b_crit, self.lo * b_s, self.hi * b_s, t["steps_ratio"], t["examples_ratio"])
        return {f"advice/{k}": float(v) for k, v in zip(ADVICE_KEYS, values, strict=True)}
