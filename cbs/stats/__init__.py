"""The statistics layer: gradient noise statistics (`noise`), the two-batch estimator and its
EMA (`smoothing`), the loop monitor (`monitor`), the sampled and whole-training-set
measurements of a sweep (`sampled`), Hessian-vector products (`curvature`), per-example
gradient norms (`ghost`, `ghost_rules`, `ghost_trace`), the checks a loss must pass
(`loss_checks`) and the pytree and per-example helpers they share (`trees`, `examples`).
Imports no other cbs package.
"""

from cbs.stats import sampled as _sampled  # noqa: F401 - registers the noise method "sampled"

__all__ = [
    "curvature", "examples", "ghost", "ghost_rules", "ghost_trace", "loss_checks", "monitor",
    "noise", "sampled", "smoothing", "trees",
]  # its modules
