"""What a `loss_fn` must be for its noise statistics to mean anything, checked once per loss_fn.

Every estimator assumes L(batch) = (1/B) Σ_i ℓ_i with ℓ_i depending on example i alone, the
same whichever batch holds it. Refused, each in one line naming the cause and the fix:

- randomness loss_fn does not take as an argument (`RANDOM_PRIMITIVES` in the jaxpr, or an
  nnx.Rngs stream): each route would draw different masks, unless `allow_randomness(loss_fn)`
  declares the draws the same for an example in every batch that holds it;
- examples coupled through a batch statistic (BatchNorm in training mode): found in the
  jaxpr (`cbs.stats.coupling`), as flax's error for a mutated statistic, or as a loss of
  examples 0 and 1 together that is not the mean of their losses alone;
- a loss SUMMED over the batch: example 0 twice gives twice its loss alone.

The value checks use examples 0 and 1 of concrete inputs; under jit they run once at trace time
on stand-ins of the same shapes and dtypes (`stand_in`). A loss_fn that cannot run on one or two
examples, gives non-finite losses, or has the jaxpr and constants of one that passed is not
value-checked.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cbs.stats import nested
from cbs.stats.coupling import coupling_site

__all__ = ["allow_randomness", "check_loss_fn"]

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]

RANDOM_PRIMITIVES = frozenset({"random_bits", "random_seed", "random_wrap", "random_fold_in",
                               "random_split", "threefry2x32", "rng_bit_generator", "rng_uniform"})
# |L([x_0, x_1]) − (ℓ_0 + ℓ_1)/2| above this fraction of |ℓ_0| + |ℓ_1| counts as coupled: above
# the rounding of a mean of two bf16 losses (2⁻⁸), below what a batch statistic of 1 vs 2
# examples does (a few per cent on the stand-ins of a small BatchNorm MLP, tens on data).
COUPLING_TOLERANCE = 0.01
_CHECKED: weakref.WeakSet = weakref.WeakSet()  # loss functions that passed every check
# programs (a jaxpr and its constants) that passed: a new closure over one loss is not rechecked
_PASSED_PROGRAMS: dict[tuple, None] = {}
_MAX_PROGRAMS = 256
_ALLOWED_FLAG = "_cbs_allow_randomness"
_COUPLED_FIX = ("so per-example gradients are undefined (a batch statistic, e.g. BatchNorm in "
                "training mode: linen mutable=['batch_stats'], nnx model.train()); measure in "
                "evaluation mode (use_running_average=True / model.eval())")


def allow_randomness(loss_fn: LossFn) -> LossFn:
    """Declares that loss_fn's random draws are the same for an example in every batch that holds
    it (a dropout mask from `jax.random.fold_in(key, example_id)`): a wrapper the randomness and
    value coupling checks let through. Reuse it: the estimators compile for it."""

    def wrapped(params: PyTree, batch: PyTree) -> jax.Array:
        return loss_fn(params, batch)

    setattr(wrapped, _ALLOWED_FLAG, True)
    vars(wrapped)["__wrapped__"] = loss_fn
    return wrapped


def check_loss_fn(loss_fn: Callable[..., jax.Array], params: PyTree, batch: PyTree,
                  *args: Any) -> None:
    """Raises ValueError (one line) when loss_fn is random, couples examples or sums (module
    docstring), once per loss_fn object. `args`: `loss_fn(params, batch, *args)`'s further
    arguments, their arrays traced like the params."""
    with contextlib.suppress(TypeError):  # a loss_fn without weak references is checked each time
        if loss_fn in _CHECKED:
            return
    allowed = getattr(loss_fn, _ALLOWED_FLAG, False)
    arrays, bind = _array_leaves(args)
    fn = lambda p, b, a: loss_fn(p, b, *bind(a))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                            (params, batch, arrays))
    try:
        jaxpr = jax.make_jaxpr(fn)(*abstract)
    except Exception as err:  # noqa: BLE001 - a mutated BatchNorm statistic is named; any
        raise_if_batch_stats(err)  # other failure (tracers closed over from an outer
        return  # transformation) is left to the computation itself
    n_params, n_batch = (len(jax.tree.leaves(t)) for t in (params, batch))
    site = coupling_site(jaxpr.jaxpr, range(n_params, n_params + n_batch))
    if site is not None:
        raise_coupled(site)
    found = sorted(random_primitives(jaxpr.jaxpr))
    if found and not allowed:
        raise ValueError(f"loss_fn draws random numbers it does not take as an argument "
                         f"({', '.join(found)} in its jaxpr, e.g. dropout with a fixed key): "
                         "the per-example and whole-batch routes would draw different masks; "
                         "run the model deterministically (dropout off) for the measurement, "
                         "or wrap loss_fn in noise.allow_randomness if each example's draws are"
                         " the same in every batch that holds it")
    # keyed by the jaxpr on the first two examples (what the value checks run), if it traces
    two = jax.tree.map(lambda x: jax.ShapeDtypeStruct((min(2, x.shape[0]), *x.shape[1:]),
                                                      x.dtype), abstract[1])
    try:
        first_two = jax.make_jaxpr(fn)(abstract[0], two, abstract[2])
    except Exception:  # noqa: BLE001 - a loss that needs more examples: keyed by the batch's
        first_two = None
    program = _program_key(first_two or jaxpr, allowed)
    if program is None or program not in _PASSED_PROGRAMS:
        losses = _sample_losses(fn, params, batch, arrays)
        if losses is not None:
            _check_values(*losses, coupling=not allowed)
        if program is not None:
            if len(_PASSED_PROGRAMS) >= _MAX_PROGRAMS:
                _PASSED_PROGRAMS.pop(next(iter(_PASSED_PROGRAMS)))
            _PASSED_PROGRAMS[program] = None
    passed(loss_fn)


def passed(loss_fn: Callable[..., jax.Array]) -> None:
    """Records that loss_fn passed every check."""
    with contextlib.suppress(TypeError):
        _CHECKED.add(loss_fn)


def _array_leaves(args: tuple) -> tuple[list[Any], Callable[[list[Any]], tuple]]:
    """The array leaves of `args` and the function that puts arrays back in their places."""
    leaves, tree = jax.tree.flatten(args)
    where = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray, np.generic))]

    def bind(arrays: list[Any]) -> tuple:
        filled = dict(zip(where, arrays, strict=True))
        return jax.tree.unflatten(tree, [filled.get(i, x) for i, x in enumerate(leaves)])

    return [leaves[i] for i in where], bind


def raise_if_batch_stats(err: Exception) -> None:
    """One line for flax's error on a BatchNorm statistic or nnx.Rngs stream mutated in a trace."""
    text = str(err)
    if "RngCount" in text or "RngKey" in text:
        raise ValueError("loss_fn draws from an nnx.Rngs stream of a model it closes over "
                         "(nnx.Dropout): each route would draw different masks; measure with "
                         "noise.nnx_value_grad_and_stats(loss_fn)(model, batch), which gives "
                         "each example its own stream key, or run the model deterministically "
                         "(model.eval())") from err
    if "BatchStat" in text or "batch_stats" in text:
        raise ValueError("loss_fn updates BatchNorm statistics (BatchNorm in training mode): a "
                         "batch statistic couples the examples, so per-example gradients are "
                         "undefined; measure with the model in evaluation mode (nnx: "
                         "model.eval(); linen: use_running_average=True, no mutable)") from err


def raise_coupled(site: str) -> None:
    """The one-line refusal of a loss coupled at `site` (`cbs.stats.coupling`)."""
    raise ValueError(f"loss_fn couples the examples of a batch: a statistic over the batch axis"
                     f" is combined with every example ({site}), {_COUPLED_FIX}")


def random_primitives(jaxpr: Any) -> set[str]:
    """The random-number primitives in a jaxpr and the jaxprs nested in it."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in RANDOM_PRIMITIVES:
            found.add(eqn.primitive.name)
        for inner in nested.sub_jaxprs(eqn):
            found |= random_primitives(inner)
    return found


def _check_values(once: float, other: float | None, pair: float | None, twice: float, *,
                  coupling: bool) -> None:
    """once = ℓ_0, other = ℓ_1, pair = L([x_0, x_1]), twice = L([x_0, x_0])."""
    if abs(twice - 2 * once) < 0.1 * abs(twice - once):
        raise ValueError(f"loss_fn looks like a SUM over the batch: example 0 twice gives "
                         f"{twice:.6g}, twice its loss alone ({once:.6g}), where a mean gives "
                         f"the same. Return the MEAN loss over the leading axis (jnp.mean, "
                         f"not jnp.sum).")
    if not coupling or other is None or pair is None:
        return
    mean = (once + other) / 2
    if abs(pair - mean) > COUPLING_TOLERANCE * (abs(once) + abs(other)) + 1e-6:
        raise ValueError(f"loss_fn couples the examples of a batch: examples 0 and 1 together "
                         f"give {pair:.6g}, not the mean {mean:.6g} of their losses alone, "
                         f"{_COUPLED_FIX}")


def _sample_losses(loss_fn: Callable[..., jax.Array], params: PyTree, batch: PyTree,
                   args: list[Any]) -> tuple[float, float | None, float | None, float] | None:
    """(ℓ_0, ℓ_1, L([x_0, x_1]), L([x_0, x_0])) of `loss_fn(params, batch, args)` on the inputs,
    or on stand-ins when any is traced; None when loss_fn cannot run or a loss is not finite."""
    if not all(concrete(x) for x in jax.tree.leaves((params, batch))):
        params = stand_in(params, kernels=True)
        batch = stand_in(jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            (min(2, x.shape[0]), *x.shape[1:]), x.dtype), batch), kernels=False)
    else:  # examples 0 and 1 only: the compiled program does not depend on the batch size
        batch = jax.tree.map(lambda x: x[:2], batch)
    size = jax.tree.leaves(batch)[0].shape[0]
    pairs = [_stand_in_arg(x) for x in args]
    args, wraps = [a for a, _ in pairs], [w for _, w in pairs]

    def losses(params, batch, args):
        take = lambda idx: jax.tree.map(lambda x: x[jnp.asarray(idx)], batch)
        args = [w(a) for w, a in zip(wraps, args, strict=True)]
        out = [loss_fn(params, take([0]), args), loss_fn(params, take([0, 0]), args)]
        if size >= 2:
            out += [loss_fn(params, take([1]), args), loss_fn(params, take([0, 1]), args)]
        return out

    try:
        with jax.ensure_compile_time_eval():
            compiled = jax.jit(losses).lower(params, batch, args).compile()  # runs now
            values = [float(v) for v in jax.device_get(compiled(params, batch, args))]
    except Exception as err:  # noqa: BLE001 - a loss that needs a larger batch (sharding,
        raise_if_batch_stats(err)  # reshapes) is left to the computation itself
        return None
    if not all(math.isfinite(v) for v in values):
        return None
    once, twice, *rest = values
    other, pair = rest if rest else (None, None)
    return once, other, pair, twice


def _stand_in_arg(x: Any) -> tuple[Any, Callable[[Any], Any]]:
    """(x when concrete, else ones of its shape and dtype (a temperature or a mask stays valid) or
    zero key data for a typed key; the function that makes that the argument again)."""
    if concrete(x):
        return x, lambda a: a
    shape, dtype = jnp.shape(x), jnp.result_type(x)
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        return (np.zeros(data.shape, data.dtype), lambda a: jax.random.wrap_key_data(a, impl=impl))
    return np.ones(shape, dtype), lambda a: a


def stand_in(tree: PyTree, *, kernels: bool, seed: int = 0) -> PyTree:
    """Concrete arrays of the tree's shapes and dtypes: floats standard normal (with
    `kernels`, parameters: matrices scaled by 1/√fan_in, vectors by 0.1), integers and
    booleans 0 or 1 (valid labels and token ids)."""
    rng = np.random.default_rng(seed)

    def one(x):
        shape, dtype = jnp.shape(x), jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.inexact):
            fan_in = (math.prod(shape[:-1]) if len(shape) >= 2 else 100) if kernels else 1
            return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(dtype)
        return rng.integers(0, 2, shape).astype(dtype)  # numpy: stays concrete under a trace

    return jax.tree.map(one, tree)


def _program_key(jaxpr: Any, allowed: bool) -> tuple | None:
    """The printed jaxpr and its constants (values where small, else shape, dtype and a checksum),
    what the value checks' verdict depends on; None when a constant has no host value."""
    consts = []
    for c in jaxpr.consts:
        try:
            a = np.asarray(c)
        except Exception:  # noqa: BLE001 - a traced constant, a key array
            return None
        consts.append((a.shape, str(a.dtype), a.tobytes() if a.size <= 4096
                       else float(np.sum(a, dtype=np.float64))))
    return (str(jaxpr.jaxpr), tuple(consts), bool(allowed))


def concrete(x: Any) -> bool:
    """A value held on this process (not a tracer, not a multi-host global array)."""
    return not isinstance(x, jax.core.Tracer) and getattr(x, "is_fully_addressable", True)
