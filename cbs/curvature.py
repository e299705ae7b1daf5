"""Hessian-vector products, and the pytree helpers the noise statistics are built from.

Letters: P number of parameters, B batch size, C chunk of examples, L loss (the MEAN loss over
the batch, DESIGN.md), H = ∇²L at `params` (the Hessian of the mean batch loss), v a pytree
shaped like `params`.

`hvp` is forward-over-reverse: Hv = d/dε ∇L(θ + εv) at ε = 0, i.e. `jax.jvp` of `jax.grad`
(Pearlmutter 1994). It costs about two gradient evaluations and never forms the P×P Hessian.
`hvp_fn` linearises ∇L once so that many HVPs at the same point (vmapped over the centred
per-example gradients in `cbs.noise.exact`) reuse the forward residuals.

The second half holds what every estimator in `cbs.noise` shares: input checks (clear
ValueErrors), parameter groups (`resolve_groups`), running under an explicitly sharded mesh and
mapping over examples in chunks (`map_examples`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


def accum_dtype() -> jnp.dtype:
    """Dtype statistics are accumulated in: float64 when `jax_enable_x64` is on, else float32."""
    return jnp.dtype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)


def tree_cast(tree: PyTree, dtype) -> PyTree:
    """Casts every leaf of `tree` to `dtype`."""
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def tree_cast_like(tree: PyTree, like: PyTree) -> PyTree:
    """Casts every leaf of `tree` to the dtype of the matching leaf of `like`."""
    return jax.tree.map(lambda x, y: x.astype(y.dtype), tree, like)


def tree_sub(a: PyTree, b: PyTree) -> PyTree:
    """Leafwise a − b."""
    return jax.tree.map(jnp.subtract, a, b)


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
    """|a|² summed over all leaves, accumulated in float32 at least (a sum of squares, which
    XLA fuses into the producer; a dot of a leaf with itself does not)."""
    dtype = accum_dtype()
    return sum((jnp.sum(jnp.square(x.astype(dtype))) for x in jax.tree.leaves(a)),
               jnp.zeros((), dtype))


def hvp(loss_fn: LossFn, params: PyTree, batch: PyTree, v: PyTree) -> PyTree:
    """Hessian-vector product H v of `loss_fn(·, batch)` at `params` (forward-over-reverse).

    Args:
        loss_fn: loss_fn(params, batch) -> scalar mean loss.
        params: point at which H is taken.
        batch: pytree of arrays with a shared leading axis.
        v: pytree shaped like `params` (cast to the parameters' dtypes).
    Returns:
        H v, a pytree shaped like `params`.
    """
    grad_fn = lambda p: jax.grad(loss_fn)(p, batch)
    return jax.jvp(grad_fn, (params,), (tree_cast_like(v, params),))[1]


def vhv(loss_fn: LossFn, params: PyTree, batch: PyTree, v: PyTree) -> jax.Array:
    """The quadratic form vᵀ H v (one HVP), accumulated in float32 at least."""
    return tree_dot(v, hvp(loss_fn, params, batch, v))


def hvp_fn(loss_fn: LossFn, params: PyTree, batch: PyTree) -> tuple[PyTree, Callable]:
    """Linearises ∇L at `params`: returns (ḡ, v ↦ H v) for many HVPs at one point.

    The returned function is linear, vmappable, and casts its input to the parameter dtypes.
    """
    grad, lin = jax.linearize(lambda p: jax.grad(loss_fn)(p, batch), params)
    return grad, lambda v: lin(tree_cast_like(v, params))


def block_quadratic_forms(hvp_lin: Callable, v: PyTree, blocks: list[list[bool]] | None
                          ) -> tuple[jax.Array, jax.Array | None]:
    """vᵀHv and, per block k, the block-diagonal form v_kᵀ H_kk v_k (one HVP per block).

    `blocks[k]` flags the leaves of block k. v_kᵀH_kk v_k is computed as ṽᵀHṽ with ṽ equal to
    v on block k and zero elsewhere. The K + 1 HVPs run one after another (lax.map), so
    memory stays that of one HVP and the HVP is compiled once. Returns (total, [K] or None).
    """
    if blocks is None:
        return tree_dot(v, hvp_lin(v)), None
    masks_KxL = jnp.asarray([[True] * len(blocks[0])] + blocks)
    leaves, treedef = jax.tree.flatten(v)

    def form(mask_L):
        vk = treedef.unflatten([jnp.where(m, x, jnp.zeros_like(x))
                                for m, x in zip(mask_L, leaves, strict=True)])
        return tree_dot(vk, hvp_lin(vk))

    forms = jax.lax.map(form, masks_KxL)
    return forms[0], forms[1:]


# --- Input checks, parameter groups and sharding, shared by the estimators in cbs.noise ---

GroupSpec = None | bool | str | Callable[[str], str]


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_paths(tree: PyTree) -> list[str]:
    """Slash-joined path of every leaf, e.g. "layers/0/kernel" (NNX's trailing .value dropped)."""
    paths = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = list(path)
        if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name == "value":
            keys = keys[:-1]
        paths.append("/".join(_key_name(k) for k in keys))
    return paths


def resolve_groups(params: PyTree, groups: GroupSpec) -> list[str] | None:
    """Group name of every leaf of `params` (leaf order), or None for no breakdown.

    groups: None/False: none. True or "auto": the module owning the leaf, i.e. its path
    without the last key ("layers/0" for "layers/0/kernel"; a top-level leaf is its own
    group). "top": the first key of the path. "leaf": every leaf alone. A callable maps the
    leaf path string ("layers/0/kernel") to a group name.
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
    leaf_groups = resolve_groups(params, groups)
    if leaf_groups is None:
        return None
    names = list(dict.fromkeys(leaf_groups))
    blocks = [[g == name for g in leaf_groups] for name in names]
    matrix_LxK = np.asarray(blocks, dtype=accum_dtype()).T
    return names, matrix_LxK, blocks


def check_inputs(loss_fn: LossFn, params: PyTree, batch: PyTree, *, min_batch: int = 2) -> int:
    """Validates (loss_fn, params, batch) and returns the batch size B (shapes only; jittable)."""
    param_leaves = jax.tree.leaves(params)
    if not param_leaves:
        raise ValueError("params has no array leaves: pass the pytree of trainable parameters.")
    bad = [p for p, x in zip(leaf_paths(params), param_leaves, strict=True)
           if not jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if bad:
        raise ValueError(f"params must have floating-point (inexact) dtypes; non-float leaves at "
                         f"{bad}. Pass only the trainable float parameters (for NNX: "
                         f"nnx.split(model, nnx.Param, ...)) and close over the rest in loss_fn.")
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch has no array leaves: pass a dict of arrays with a leading axis.")
    shapes = {p: jnp.shape(x) for p, x in zip(leaf_paths(batch), leaves, strict=True)}
    if any(len(s) == 0 for s in shapes.values()) or len({s[0] for s in shapes.values()}) != 1:
        raise ValueError(f"every batch leaf needs the same leading (example) axis; got shapes "
                         f"{shapes}. Give all leaves the batch size as their first dimension.")
    batch_size = next(iter(shapes.values()))[0]
    if batch_size < min_batch:
        raise ValueError(f"batch size B={batch_size} is too small: trace_sigma is the unbiased "
                         f"estimate with 1/(B-1), which needs B >= {min_batch} examples. Pass a "
                         f"batch of at least {min_batch} examples.")
    loss = jax.eval_shape(loss_fn, params, batch)
    if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != ():
        shape = getattr(loss, "shape", type(loss).__name__)
        raise ValueError(f"loss_fn must return a scalar (the MEAN loss over the batch); got "
                         f"{shape}. Reduce per-example losses with jnp.mean over the batch axis.")
    return batch_size


def run_auto_axes(fn: Callable, *args):
    """Calls fn(*args), switching explicitly sharded mesh axes to automatic inside it.

    Per-example slicing and chunking reshape the (possibly sharded) batch axis, which
    explicit sharding refuses; under automatic axes the compiler partitions them. Outputs
    are replicated. Without explicit axes (no mesh, or an Auto mesh) fn is called as is.
    """
    for leaf in jax.tree.leaves(args):
        mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        if mesh is None or not mesh.axis_names:
            continue
        axes = tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                     if t == jax.sharding.AxisType.Explicit)
        if axes:
            with jax.sharding.use_abstract_mesh(mesh):
                return jax.sharding.auto_axes(fn, axes=axes, out_sharding=jax.P())(*args)
    return fn(*args)


def one_example(example: PyTree) -> PyTree:
    """Turns one example (leaves without the batch axis) into a batch of size 1."""
    return jax.tree.map(lambda x: x[None], example)


def map_examples(fn: Callable, batch: PyTree, chunk_size: int | None) -> PyTree:
    """fn(example) for every example, stacked [B, ...]: vmap in a chunk, lax.scan across n chunks.

    The chunk is shrunk to ceil(B/n) ≤ chunk_size and the batch padded with copies of its
    last example (outputs dropped), so the body is compiled once. Chunk j holds examples
    j, j + n, j + 2n, ..., so a batch sharded over devices stays spread over them.
    """
    size = jax.tree.leaves(batch)[0].shape[0]
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of examples, got {chunk_size}.")
    if chunk_size is None or chunk_size >= size:
        return jax.vmap(fn)(batch)
    n = -(-size // chunk_size)
    chunk = -(-size // n)
    pad = lambda x: jnp.concatenate([x, jnp.repeat(x[-1:], n * chunk - size, axis=0)])
    chunks = jax.tree.map(
        lambda x: pad(x).reshape(chunk, n, *x.shape[1:]).swapaxes(0, 1), batch)
    _, ys = jax.lax.scan(lambda c, xs: (c, jax.vmap(fn)(xs)), None, chunks)
    return jax.tree.map(lambda y: y.swapaxes(0, 1).reshape(n * chunk, *y.shape[2:])[:size], ys)
