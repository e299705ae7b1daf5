"""`cbs.curvature`: the public API of `cbs.stats.curvature`, re-exported.

Hessian-vector products, and the pytree helpers the noise statistics are built from.
"""

from cbs.stats.curvature import (  # noqa: F401
    block_quadratic_forms,
    hvp,
    hvp_fn,
    tree_cast_like,
    tree_dot,
    vhv,
)
