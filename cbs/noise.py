"""`cbs.noise`, the simple and curvature-aware noise scales, re-exports `cbs.stats.noise` (the
estimators), `cbs.stats.dropin` (for a training loop), `cbs.stats.smoothing` (two-batch
estimator, EMA), `cbs.stats.loss_checks` and `cbs.stats.monitor` (the loop monitor)."""

from cbs.stats.dropin import (
    example_keys,
    keyed_loss,
    nnx_value_grad_and_stats,
    value_grad_and_stats,
    with_keys,
)
from cbs.stats.loss_checks import allow_randomness, check_loss_fn
from cbs.stats.monitor import NoiseMonitor
from cbs.stats.noise import (
    CURVATURE_KEYS,
    METHOD_ARGUMENTS,
    SIMPLE_KEYS,
    STAT_KEYS,
    MethodFn,
    NoiseStats,
    exact,
    get_method,
    method_arguments,
    method_names,
    per_example_sq_norms,
    probe,
    register_method,
)
from cbs.stats.smoothing import NoiseScaleEMA, two_batch

__all__ = [
    "CURVATURE_KEYS", "METHOD_ARGUMENTS", "SIMPLE_KEYS", "STAT_KEYS", "MethodFn", "NoiseMonitor",
    "NoiseScaleEMA", "NoiseStats", "allow_randomness", "check_loss_fn", "exact", "example_keys",
    "get_method", "keyed_loss", "method_arguments", "method_names", "nnx_value_grad_and_stats",
    "per_example_sq_norms", "probe", "register_method", "two_batch", "value_grad_and_stats",
    "with_keys",
]
