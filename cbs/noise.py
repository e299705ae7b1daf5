"""`cbs.noise`: the public API of `cbs.stats.noise`, re-exported, the drop-in for a
training loop of `cbs.stats.dropin`, and the loop monitor of `cbs.stats.monitor`.

Gradient-noise statistics: the simple and curvature-aware noise scales of a model.
"""

from cbs.stats.dropin import (  # noqa: F401
    example_keys,
    keyed_loss,
    nnx_value_grad_and_stats,
    value_grad_and_stats,
    with_keys,
)
from cbs.stats.monitor import NoiseMonitor  # noqa: F401
from cbs.stats.noise import (  # noqa: F401
    CURVATURE_KEYS,
    SIMPLE_KEYS,
    STAT_KEYS,
    NoiseScaleEMA,
    NoiseStats,
    allow_randomness,
    block_quadratic_forms,
    check_inputs,
    exact,
    get_method,
    group_matrix,
    hvp_fn,
    method_names,
    per_example_sq_norms,
    probe,
    register_method,
    run_auto_axes,
    takes_hessian_batch,
    two_batch,
)
