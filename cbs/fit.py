"""`cbs.fit`: the public API of `cbs.analysis.fit`, re-exported.

Fits of the steps–examples trade-off and of B_crit against loss (numpy/scipy, no model).
"""

from cbs.analysis.fit import (  # noqa: F401
    INSUFFICIENT,
    OK,
    BestPerBatchSize,
    PowerLawFit,
    TradeoffFit,
    alpha_interval,
    best_per_batch_size,
    fit_power_law,
    fit_tradeoff,
    json_ready,
    model_log_steps,
    noise_scale_at_crossing,
    quantile_interval,
    steps_to_target,
    studentized,
    tradeoff_warnings,
)
