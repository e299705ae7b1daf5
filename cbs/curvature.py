"""`cbs.curvature` re-exports `cbs.stats.curvature`: Hessian-vector products and the quadratic
forms the curvature-aware noise scale is built from."""

from cbs.stats.curvature import block_quadratic_forms, hvp, hvp_fn, vhv

__all__ = ["block_quadratic_forms", "hvp", "hvp_fn", "vhv"]
