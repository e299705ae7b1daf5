"""`cbs.fit` re-exports `cbs.analysis.fits.fit` (fits of the steps–examples trade-off and of
B_crit against loss) and `cbs.analysis.fits.selection` (from trial records to fit points)."""

from cbs.analysis.fits.fit import (
    INSUFFICIENT,
    OK,
    PowerLawFit,
    TradeoffFit,
    alpha_interval,
    fit_power_law,
    fit_tradeoff,
    g3,
    json_ready,
    model_log_steps,
    quantile_interval,
    solve,
    studentized,
    tradeoff_warnings,
)
from cbs.analysis.fits.selection import (
    BestPerBatchSize,
    best_per_batch_size,
    noise_scale_at_crossing,
    steps_to_target,
)

__all__ = [
    "INSUFFICIENT", "OK", "BestPerBatchSize", "PowerLawFit", "TradeoffFit", "alpha_interval",
    "best_per_batch_size", "fit_power_law", "fit_tradeoff", "g3", "json_ready", "model_log_steps",
    "noise_scale_at_crossing", "quantile_interval", "solve", "steps_to_target", "studentized",
    "tradeoff_warnings",
]
