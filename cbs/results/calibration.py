"""The calibration file and the prediction its model gives: B_crit from one noise scale.

The calibration (fitted by `cbs.analysis.advice.calibration`, written by `cbs-compare`; the
package ships one, `shipped`) is per noise scale ("b_simple", "b_noise") a random-effects model
of log(B_crit/B_s) per optimizer family, `{"families": {f: {"mu", "var_mu", "studies"}},
"tau2", "sigma2", "dof", ...}`. A new task's B_crit is predicted as log B_crit = log B_s + μ̂_f,
with the interval μ̂_f ± t_{q, ν}·√(τ̂² + σ̂² + var(μ̂_f)) (`predict`); `tradeoff` is what a
batch size costs against it.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Mapping
from typing import Any

__all__ = ["CALIBRATION_FILE", "family", "predict", "shipped", "t_quantile", "tradeoff"]

CALIBRATION_FILE = "calibration.json"
FAMILIES = {"sgd": "sgd", "momentum": "sgd", "adam": "adaptive", "adamw": "adaptive"}


def family(optimizer: str) -> str:
    """The optimizer family of a config's `optim.name` ("sgd" or "adaptive")."""
    try:
        return FAMILIES[optimizer.lower()]
    except KeyError:
        raise ValueError(f"no calibrated family for optimizer {optimizer!r}; known: "
                         f"{sorted(FAMILIES)}") from None


def t_quantile(p: float, dof: float) -> float:
    """Student's t quantile (`scipy.stats.t.ppf`), imported here, not with the module: every
    training run imports this module, and scipy would add about 1 s to its start."""
    from scipy.special import stdtrit

    return float(stdtrit(dof, p))


def predict(model: Mapping[str, Any], noise_scale: float, optimizer: str, *,
            level: float = 0.8) -> dict[str, Any]:
    """Predicted B_crit for a measured noise scale (the model's scale) and optimizer: the
    point estimate and the `level` prediction interval, with the ratio it used."""
    f = model["families"].get(family(optimizer))
    if f is None:
        raise ValueError(f"the calibration has no {family(optimizer)!r} study; it covers "
                         f"{sorted(model['families'])}")
    sd = math.sqrt(model["tau2"] + model["sigma2"] + f["var_mu"])
    t = t_quantile(0.5 + level / 2, model["dof"])
    centre = math.log(noise_scale) + f["mu"]
    return {"b_crit": math.exp(centre), "interval": (math.exp(centre - t * sd),
                                                     math.exp(centre + t * sd)),
            "level": level, "ratio": math.exp(f["mu"]), "log_sd": sd}


def shipped() -> dict[str, Any]:
    """The calibration file shipped with the package."""
    path = pathlib.Path(__file__).parent / "shipped" / CALIBRATION_FILE
    return json.loads(path.read_text())


def tradeoff(batch_size: float, b_crit: float, *, exchange: float | None = None
             ) -> dict[str, float]:
    """What batch size B costs against the critical batch (McCandlish et al. 2018, eqs. 2.7
    and 2.11): steps S/S_min = 1 + B_crit/B, examples E/E_min = 1 + B/B_crit; and, for an
    exchange rate λ (examples one would spend to save one step), the B minimising
    λ·S + E, √(λ·B_crit) (B_crit itself at λ = B_crit, where both overheads are 2×)."""
    out = {"steps_ratio": 1.0 + b_crit / batch_size, "examples_ratio": 1.0 + batch_size / b_crit}
    if exchange is not None:
        out["best_batch_size"] = math.sqrt(exchange * b_crit)
    return out
