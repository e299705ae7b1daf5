"""The statistics layer: gradient noise statistics (`noise`), the drop-in for a training
loop (`dropin`), the sampled and whole-training-set measurements of a sweep (`sampled`),
Hessian-vector products (`curvature`), per-example gradient norms (`ghost`, `ghost_rules`,
`ghost_tied` for a leaf read by several uses, `ghost_trace`), the nested primitives every
jaxpr walker enters, read alike on every JAX release (`nested`), the two-batch estimator and
its EMA (`smoothing`), the loop monitor (`monitor`), the noise scale of a preconditioned
update (`preconditioned`), the loss checks (`loss_checks`, `coupling`) and the pytree and
per-example helpers they share (`trees`, `examples`). Imports no other cbs package.
"""

from cbs.stats import sampled as _sampled  # noqa: F401 - registers "sampled", "full_data"

__all__ = [
    "coupling", "curvature", "dropin", "examples", "ghost", "ghost_rules", "ghost_tied",
    "ghost_trace", "loss_checks", "monitor", "nested", "noise", "preconditioned", "sampled",
    "smoothing", "trees",
]  # its modules
