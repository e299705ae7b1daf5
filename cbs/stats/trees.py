"""Pytree helpers of the noise statistics: casts, dot products, norms, leaf paths, parameter
groups. Sums of squares and dot products accumulate in `accum_dtype()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "GroupSpec", "PyTree", "accum_dtype", "group_matrix", "leaf_dots", "leaf_paths",
    "resolve_groups", "tree_cast", "tree_cast_like", "tree_dot", "tree_sq_norm",
]

PyTree = Any


def accum_dtype() -> jnp.dtype:
    """Dtype statistics are accumulated in: float64 when `jax_enable_x64` is on, else float32."""
    x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]  # a flag set at run time
    return jnp.dtype(jnp.float64 if x64 else jnp.float32)


def tree_cast(tree: PyTree, dtype) -> PyTree:
    """Casts every leaf of `tree` to `dtype`."""
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def tree_cast_like(tree: PyTree, like: PyTree) -> PyTree:
    """Casts every leaf of `tree` to the dtype of the matching leaf of `like`."""
    return jax.tree.map(lambda x, y: x.astype(y.dtype), tree, like)


def leaf_dots(a: PyTree, b: PyTree) -> list[jax.Array]:
    """Per-leaf inner products ⟨a_leaf, b_leaf⟩ in the accumulation dtype (a list of scalars)."""
    dtype = accum_dtype()
    return [jnp.vdot(x.astype(dtype).ravel(), y.astype(dtype).ravel())
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]


def tree_dot(a: PyTree, b: PyTree) -> jax.Array:
    """⟨a, b⟩ summed over all leaves, accumulated in float32 at least."""
    dots = leaf_dots(a, b)
    return sum(dots[1:], dots[0]) if dots else jnp.zeros((), accum_dtype())


def tree_sq_norm(a: PyTree) -> jax.Array:
    """|a|² summed over all leaves, accumulated in float32 at least (a sum of squares: XLA
    fuses it into the producer, a dot of a leaf with itself not)."""
    dtype = accum_dtype()
    return sum((jnp.sum(jnp.square(x.astype(dtype))) for x in jax.tree.leaves(a)),
               jnp.zeros((), dtype))


GroupSpec = None | bool | str | Callable[[str], str]


def leaf_paths(tree: PyTree) -> list[str]:
    """Slash-joined path of every leaf, e.g. "layers/0/kernel" (NNX's trailing .value dropped)."""
    name = lambda k: str(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k))
    paths = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = list(path)
        if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name == "value":
            keys = keys[:-1]
        paths.append("/".join(name(k) for k in keys))
    return paths


def resolve_groups(params: PyTree, groups: GroupSpec) -> list[str] | None:
    """Group name of every leaf of `params` (leaf order), or None for no breakdown.

    groups: None/False: none. True or "auto": the leaf's path without the last key
    ("layers/0" for "layers/0/kernel"; a top-level leaf is its own group). "top": the first
    key. "leaf": every leaf alone. A callable maps the leaf path to a group name.
    """
    if groups is None or groups is False:
        return None
    paths = leaf_paths(params)
    if groups is True or groups == "auto":
        return [p.rsplit("/", 1)[0] if "/" in p else p for p in paths]
    if groups == "top":
        return [p.split("/", 1)[0] for p in paths]
    if groups == "leaf":
        return paths
    if callable(groups):
        return [str(groups(p)) for p in paths]
    raise ValueError(f"groups must be None, True, 'auto', 'top', 'leaf' or a callable "
                     f"path -> group name, got {groups!r}.")


def group_matrix(params: PyTree, groups: GroupSpec
                 ) -> tuple[list[str], np.ndarray, list[list[bool]]] | None:
    """(group names, 0/1 matrix [L, K] mapping leaves to groups, per-group leaf flags)."""
    if (leaf_groups := resolve_groups(params, groups)) is None:
        return None
    names = list(dict.fromkeys(leaf_groups))
    blocks = [[g == name for g in leaf_groups] for name in names]
    matrix_LxK = np.asarray(blocks, dtype=accum_dtype()).T
    return names, matrix_LxK, blocks
