"""The statistics layer: gradient noise statistics (`noise`), the drop-in for a training
loop (`dropin`), the sampled and whole-training-set measurements of a sweep (`sampled`),
Hessian-vector products (`curvature`), per-example gradient norms (`ghost`, `ghost_rules`),
the loss checks (`loss_checks`, `coupling`) and the pytree and per-example helpers they
share (`trees`, `examples`). Imports no other cbs package.
"""

from cbs.stats import sampled as _sampled  # noqa: F401 - registers "sampled", "full_data"
