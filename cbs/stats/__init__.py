"""The statistics layer: gradient noise statistics (`noise`), the training-loop drop-in (`dropin`),
sampled and whole-training-set measurements (`sampled`), Hessian-vector products (`curvature`),
per-example gradient norms (`ghost`, `ghost_rules`, `ghost_tied`, `ghost_trace`), nested primitives
read alike on every JAX release (`nested`), the two-batch estimator and EMA (`smoothing`), the loop
monitor (`monitor`), preconditioned noise scales (`preconditioned`), loss checks (`loss_checks`,
`coupling`) and shared helpers (`trees`, `examples`). Imports no other cbs package.
"""

from cbs.stats import sampled as _sampled  # noqa: F401 - registers "sampled", "full_data"

__all__ = [
    "coupling", "curvature", "dropin", "examples", "ghost", "ghost_rules", "ghost_tied",
    "ghost_trace", "loss_checks", "monitor", "nested", "noise", "preconditioned", "sampled",
    "smoothing", "trees",
]  # its modules
