"""The drop-in for a training loop: `jax.value_and_grad` that also returns the noise statistics
of the same batch (`value_grad_and_stats`), and its NNX form (`nnx_value_grad_and_stats`).
Arguments follow jax_privacy's `clipped_grad`; docs/guides/measuring.md shows both in use.

Randomness. With a key, example i of the batch draws from `example_keys(key, B)[i] =
jax.random.fold_in(key, i)` and ℓ_i = loss_fn(..., batch[i:i+1], ..., fold_in(key, i)), with
L = (1/B) Σ_i ℓ_i on every route. In the NNX form each `nnx.Rngs` stream's key plays the key.

Curvature. Each half of the batch (even positions, B_e = ⌈B/2⌉; odd, B_o = ⌊B/2⌋) has its
deviations weighed by the Hessian of the other half's mean loss; with h ∈ {e, o} and h' the other:

    trace_h_sigma = ½ Σ_h Σ_{i∈h} (g_i − ḡ_h)ᵀ H_h' (g_i − ḡ_h) / (B_h − 1)
    mean_g_h_g    = ½ Σ_h ḡ_hᵀ H_h' ḡ_h
    g_h_g         = ½ Σ_h (ḡ_hᵀ H_h' ḡ_h − tr(H_h'Σ)_h / B_h)       unbiased for GᵀHG
    b_noise       = trace_h_sigma / g_h_g

Cost: B per-example gradients and B HVPs over B/2 examples each. The simple fields come from
the whole batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from cbs.stats import coupling, examples, ghost, loss_checks
from cbs.stats.examples import PyTree, check_inputs, run_auto_axes
from cbs.stats.noise import NoiseStats, _assemble, _check_method, _fast_sums, _vmap_sums
from cbs.stats.trees import GroupSpec, group_matrix

__all__ = ["example_keys", "keyed_loss", "nnx_value_grad_and_stats", "value_grad_and_stats",
           "with_keys"]

Argnums = int | Sequence[int]


def example_keys(key: jax.Array, batch_size: int) -> jax.Array:
    """`jax.random.fold_in(key, i)` for each position i < B: [B] (typed) or [B, 2] (raw keys)."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch_size))


def _is_typed(key: jax.Array) -> bool:
    return jnp.issubdtype(key.dtype, jax.dtypes.prng_key)


def _wrapper(keys: PyTree) -> Callable[[PyTree], PyTree]:
    """The function that turns key data (`with_keys`) back into keys like `keys` (a key or a
    pytree of keys)."""
    impls = [jax.random.key_impl(k) if _is_typed(k) else None for k in jax.tree.leaves(keys)]
    wrap = lambda d, impl: d if impl is None else jax.random.wrap_key_data(d, impl=impl)
    return lambda data: jax.tree.unflatten(jax.tree.structure(data), [
        wrap(d, impl) for d, impl in zip(jax.tree.leaves(data), impls, strict=True)])


def keyed_loss(loss_fn: Callable[[PyTree, PyTree, jax.Array], jax.Array], key: jax.Array
               ) -> Callable[[PyTree, PyTree], jax.Array]:
    """`L(params, (batch, data)) = (1/B) Σ_i loss_fn(params, batch[i:i+1], key_i)`, key_i
    unwrapped from data[i] (`with_keys`), let through the randomness check. Reuse it (the
    estimators compile for it)."""
    wrap = _wrapper(key)

    def loss(params: PyTree, batch_and_keys: tuple[PyTree, jax.Array]) -> jax.Array:
        batch, data = batch_and_keys
        one = lambda ex, k: loss_fn(params, examples.one_example(ex), wrap(k))
        return jnp.mean(jax.vmap(one)(batch, data))

    return loss_checks.allow_randomness(loss)


def with_keys(batch: PyTree, key: PyTree) -> tuple[PyTree, PyTree]:
    """(batch, per-example key data as uint32 batch leaves): the batch `keyed_loss` takes.
    `key`: a key or a pytree of keys."""
    size = jax.tree.leaves(batch)[0].shape[0]
    keys = jax.tree.map(lambda k: example_keys(k, size), key)
    return batch, jax.tree.map(lambda k: jax.random.key_data(k) if _is_typed(k) else k, keys)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Which positional arguments are the params, the batch and the key."""

    argnums: tuple[int, ...]
    batch_argnums: tuple[int, ...]
    prng_argnum: int | None
    single_params: bool
    single_batch: bool

    @classmethod
    def of(cls, argnums: Argnums, batch_argnums: Argnums, prng_argnum: int | None) -> _Spec:
        a = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        b = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
        named = [*a, *b, *(() if prng_argnum is None else (prng_argnum,))]
        if not a or not b or len(set(named)) != len(named) or min(named) < 0:
            raise ValueError(f"argnums={argnums}, batch_argnums={batch_argnums} and prng_argnum"
                             f"={prng_argnum} must name distinct non-negative positions, and "
                             "at least one each of params and batch")
        return cls(a, b, prng_argnum, isinstance(argnums, int), isinstance(batch_argnums, int))

    def split(self, args: tuple) -> tuple[PyTree, PyTree, Any, dict[int, Any]]:
        """(params, batch, key, the other arguments by position)."""
        if max(*self.argnums, *self.batch_argnums, self.prng_argnum or 0) >= len(args):
            raise ValueError(f"got {len(args)} arguments; argnums={self.argnums}, batch_argnums"
                             f"={self.batch_argnums}, prng_argnum={self.prng_argnum}")
        pick = lambda nums, single: args[nums[0]] if single else tuple(args[i] for i in nums)
        named = {*self.argnums, *self.batch_argnums, self.prng_argnum}
        return (pick(self.argnums, self.single_params), pick(self.batch_argnums, self.single_batch),
                None if self.prng_argnum is None else args[self.prng_argnum],
                {i: a for i, a in enumerate(args) if i not in named})

    def call(self, loss_fn: Callable, params, batch, key, others: dict[int, Any],
             kwargs: dict[str, Any] | None = None):
        args = dict(others)
        args.update(zip(self.argnums, (params,) if self.single_params else params, strict=True))
        args.update(zip(self.batch_argnums, (batch,) if self.single_batch else batch, strict=True))
        if self.prng_argnum is not None:
            args[self.prng_argnum] = key
        return loss_fn(*(args[i] for i in range(len(args))), **(kwargs or {}))


def value_grad_and_stats(loss_fn: Callable[..., Any], *, has_aux: bool = False,
                         argnums: Argnums = 0, batch_argnums: Argnums = 1,
                         prng_argnum: int | None = None, curvature: bool = False,
                         method: str = "auto", chunk_size: int | None = None,
                         groups: GroupSpec = None) -> Callable[..., tuple[Any, PyTree, NoiseStats]]:
    """Drop-in for `jax.value_and_grad(loss_fn, argnums, has_aux)` that also returns the noise
    statistics of the batch: fn(*args, **kwargs) -> (loss or (loss, aux), grads, NoiseStats),
    keyword arguments passed to loss_fn undifferentiated. Jittable; one forward and one backward
    pass where `cbs.stats.ghost` covers every leaf.

    Args:
        loss_fn: the MEAN loss over the batch's leading axis (or `(loss, aux)`).
        has_aux: aux is loss_fn's own on the whole batch; with a key each example's, stacked.
        batch_argnums: the argument(s) holding the examples, every leaf with leading axis B.
        prng_argnum: a PRNG key argument: example i gets `fold_in(key, i)` (module docstring).
        curvature: also B_noise, from the even and odd halves (module docstring).
        method, chunk_size, groups: as in `noise.exact`.
    """
    _check_method(method)
    spec = _Spec.of(argnums, batch_argnums, prng_argnum)
    plain = (spec.argnums, spec.batch_argnums, has_aux, prng_argnum) == ((0,), (1,), False, None)

    def fn(*args: Any, **kwargs: Any) -> tuple[Any, PyTree, NoiseStats]:
        params, batch, key, others = spec.split(args)
        value = (lambda out: out[0]) if has_aux else (lambda out: out)
        call = lambda p, b, k: spec.call(loss_fn, p, b, k, others, kwargs)
        if key is None:
            loss = (loss_fn if plain and len(args) == 2 and not kwargs
                    else (lambda p, b: value(call(p, b, None))))
            if others or kwargs:  # checked with them as arguments: under jit they are traced
                loss_checks.check_loss_fn(lambda p, b, o, kw: value(spec.call(
                    loss_fn, p, b, None, o, kw)), params, batch, others, kwargs)
                loss_checks.passed(loss)
            aux_fn = (lambda p, b: call(p, b, None)[1]) if has_aux else None
            measured = batch
        else:
            site = coupling.loss_coupling(lambda p, b, k: value(call(p, b, k)), params, batch, key)
            if site is not None:  # the structural check on the whole batch's loss with one key
                loss_checks.raise_coupled(site)
            loss = keyed_loss(lambda p, b, k: value(call(p, b, k)), key)
            measured = with_keys(batch, key)
            wrap = _wrapper(key)
            one = lambda p, ex, k: call(p, examples.one_example(ex), wrap(k))[1]
            aux_fn = (lambda p, bk: jax.vmap(lambda ex, k: one(p, ex, k))(*bk)) if has_aux else None
        return _measure(loss, aux_fn, params, measured, method=method, chunk_size=chunk_size,
                        groups=groups, curvature=curvature, has_aux=has_aux)

    return fn


def _measure(loss: Callable, aux_fn: Callable | None, params: PyTree, batch: PyTree, *,
             method: str, chunk_size: int | None, groups: GroupSpec, curvature: bool,
             has_aux: bool) -> tuple[Any, PyTree, NoiseStats]:
    batch_size = check_inputs(loss, params, batch, min_batch=4 if curvature else 2)
    grouping = group_matrix(params, groups)

    def compute(params, batch):
        if method == "vmap":
            value, grad = jax.value_and_grad(loss)(params, batch)
            sums = _vmap_sums(loss, params, batch, chunk_size, False, None)
        else:
            value, grad, sq_norms = ghost.per_example_grads_info(
                loss, params, batch, method=method, chunk_size=chunk_size)
            sums = _fast_sums(batch_size, grad, sq_norms)
        stats = _assemble(batch_size, sums, grouping)
        if curvature:
            stats = _with_curvature(stats, loss, params, batch, chunk_size, grouping)
        # the first forward pass again: XLA's common-subexpression elimination merges them
        aux = aux_fn(params, batch) if aux_fn is not None else None
        return value, aux, grad, stats

    value, aux, grad, stats = run_auto_axes(compute, params, batch)
    return ((value, aux) if has_aux else value), grad, stats


def _with_curvature(stats: NoiseStats, loss: Callable, params: PyTree, batch: PyTree,
                    chunk_size: int | None, grouping) -> NoiseStats:
    blocks = grouping[2] if grouping else None
    halves = [jax.tree.map(lambda x, s=s: x[s::2], batch) for s in (0, 1)]
    sizes = [jax.tree.leaves(h)[0].shape[0] for h in halves]
    sums = [_vmap_sums(loss, params, halves[h], chunk_size, True, blocks, halves[1 - h])
            for h in (0, 1)]

    def fields(dhd: str, ghg: str, k: int | None = None) -> dict[str, Any]:
        pick = (lambda s, n: s[n]) if k is None else (lambda s, n: s[n][k])
        ths = [pick(s, dhd) / (n - 1) for s, n in zip(sums, sizes, strict=True)]
        mghg = [pick(s, ghg) for s in sums]
        ghg_u = [m - t / n for m, t, n in zip(mghg, ths, sizes, strict=True)]
        trace_h_sigma, g_h_g = (ths[0] + ths[1]) / 2, (ghg_u[0] + ghg_u[1]) / 2
        return dict(trace_h_sigma=trace_h_sigma, g_h_g=g_h_g, b_noise=trace_h_sigma / g_h_g,
                    mean_g_h_g=(mghg[0] + mghg[1]) / 2)

    group_stats = stats.groups
    if grouping is not None and stats.groups is not None:
        group_stats = {name: dataclasses.replace(stats.groups[name], **fields("dhd_K", "ghg_K", k))
                       for k, name in enumerate(grouping[0])}
    return dataclasses.replace(stats, groups=group_stats, **fields("dhd", "ghg"))


def nnx_value_grad_and_stats(loss_fn: Callable[..., Any], *, has_aux: bool = False,
                             wrt: Any = nnx.Param, curvature: bool = False, method: str = "auto",
                             chunk_size: int | None = None, groups: GroupSpec = None
                             ) -> Callable[..., tuple[Any, nnx.State, NoiseStats]]:
    """The NNX form: `fn(model, batch, *args)` -> (loss or (loss, aux), grads, NoiseStats) for
    `loss_fn(model, batch, *args)`, differentiating the `wrt` variables (a State, as
    `nnx.value_and_grad` returns them); the rest of the model and `args` pass through. Eager or
    inside `nnx.jit`; BatchNorm in training mode is refused (measure after `model.eval()`).
    Other arguments as in `value_grad_and_stats`."""
    _check_method(method)
    value = (lambda out: out[0]) if has_aux else (lambda out: out)

    def fn(model: nnx.Module, batch: PyTree, *args: Any) -> tuple[Any, nnx.State, NoiseStats]:
        graphdef, params, keys, rest = nnx.split(model, wrt, nnx.RngKey, ...)  # type: ignore[misc]
        fresh = lambda state: jax.tree.map(lambda x: x, state)  # Variables of this trace
        merged = lambda p, k, r: nnx.merge(graphdef, p, fresh(k), fresh(r))
        call = lambda p, b, k, r, *a: loss_fn(merged(p, k, r), b, *a)
        random = loss_checks.random_primitives(jax.make_jaxpr(
            lambda p, b: value(call(p, b, keys, rest, *args)))(params, batch).jaxpr)
        # the keys per example when it draws; else they, the model's other state and the
        # arguments pass through, checked as arguments (traced in nnx.jit)
        out = value_grad_and_stats(
            call, has_aux=has_aux, prng_argnum=2 if random else None, curvature=curvature,
            method=method, chunk_size=chunk_size, groups=groups)(params, batch, keys, rest, *args)
        if random:  # the streams' counts after one call (the forward itself is dead code under jit)
            counted = merged(params, keys, rest)
            loss_fn(counted, jax.tree.map(lambda x: x[:1], batch), *args)
            nnx.update(model, nnx.state(counted, nnx.RngCount))
        return out

    return fn
