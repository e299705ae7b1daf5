"""`cbs.noise`: the public API of `cbs.stats.noise` (the estimators and their registry),
`cbs.stats.dropin` (the drop-in for a training loop), `cbs.stats.smoothing` (the two-batch
estimator and its EMA), `cbs.stats.loss_checks` (the refusal of losses without per-example
gradients) and `cbs.stats.monitor` (the loop monitor), re-exported: `__all__` is the union of
theirs.

Gradient-noise statistics: the simple and curvature-aware noise scales of a model.
"""

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
