"""Gradient-noise statistics: the simple and curvature-aware noise scales of a model.

Letters (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"): B batch size,
ℓ_i the loss of example i, L = (1/B) Σ_i ℓ_i the mean batch loss (what `loss_fn` returns),
g_i = ∇ℓ_i, ḡ = ∇L = (1/B) Σ_i g_i, G the population gradient, Σ the per-example gradient
covariance, H = ∇²L at `params` (Hessian of the MEAN BATCH loss).

    trace_sigma       = Σ_i |g_i − ḡ|² / (B − 1)                  unbiased for tr Σ
    mean_grad_sq_norm = |ḡ|²                                      E = |G|² + tr Σ / B
    grad_sq_norm      = |ḡ|² − trace_sigma / B                    unbiased for |G|²
    b_simple          = trace_sigma / grad_sq_norm                eq. 2.11
    trace_h_sigma     = Σ_i (g_i − ḡ)ᵀ H (g_i − ḡ) / (B − 1)
    mean_g_h_g        = ḡᵀ H ḡ
    g_h_g             = ḡᵀ H ḡ − trace_h_sigma / B
    b_noise           = trace_h_sigma / g_h_g                     eq. 2.8

Estimators: `exact` (per-example gradients) and `probe` (Hutchinson, memory O(params)), and the
registry of methods `config.noise.method` names (`register_method`). ℓ_i is `loss_fn` on a
one-example batch (`cbs.stats.loss_checks`). Each estimator compiles with `loss_fn` as a static
argument: reuse one function object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from cbs.stats import examples, ghost, trees
from cbs.stats.curvature import block_quadratic_forms, hvp_fn
from cbs.stats.examples import LossFn, PyTree, check_inputs, run_auto_axes
from cbs.stats.trees import GroupSpec, group_matrix

__all__ = [
    "CURVATURE_KEYS", "METHOD_ARGUMENTS", "SIMPLE_KEYS", "STAT_KEYS", "MethodFn", "NoiseStats",
    "exact", "get_method", "method_arguments", "method_names", "per_example_sq_norms", "probe",
    "register_method",
]

# The statistics of a measurement, recorded as `noise/<key>`: the one list every consumer reads.
SIMPLE_KEYS = ("mean_grad_sq_norm", "grad_sq_norm", "trace_sigma", "b_simple")
CURVATURE_KEYS = ("mean_g_h_g", "g_h_g", "trace_h_sigma", "b_noise")
STAT_KEYS = SIMPLE_KEYS + CURVATURE_KEYS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoiseStats:
    """Noise statistics of one batch (scalars); curvature fields are None unless requested."""

    batch_size: int = dataclasses.field(metadata=dict(static=True))
    mean_grad_sq_norm: jax.Array
    grad_sq_norm: jax.Array
    trace_sigma: jax.Array
    b_simple: jax.Array
    mean_g_h_g: jax.Array | None = None
    g_h_g: jax.Array | None = None
    trace_h_sigma: jax.Array | None = None
    b_noise: jax.Array | None = None
    groups: dict[str, NoiseStats] | None = None

    def to_dict(self, prefix: str = "noise/") -> dict[str, jax.Array]:
        """Flat metrics: `noise/b_simple`, ..., and `noise/<group>/b_simple` per group."""
        out = {prefix + f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("batch_size", "groups") and getattr(self, f.name) is not None}
        for name, stats in (self.groups or {}).items():
            out.update(stats.to_dict(f"{prefix}{name}/"))
        return out


def _make_stats(batch_size: int, mean_sq, trace_sigma, mean_ghg=None, trace_h_sigma=None,
                groups=None) -> NoiseStats:
    grad_sq_norm = mean_sq - trace_sigma / batch_size
    curv = {}
    if trace_h_sigma is not None:
        g_h_g = mean_ghg - trace_h_sigma / batch_size
        curv = dict(mean_g_h_g=mean_ghg, g_h_g=g_h_g, trace_h_sigma=trace_h_sigma,
                    b_noise=trace_h_sigma / g_h_g)
    return NoiseStats(batch_size=batch_size, mean_grad_sq_norm=mean_sq, grad_sq_norm=grad_sq_norm,
                      trace_sigma=trace_sigma, b_simple=trace_sigma / grad_sq_norm,
                      groups=groups, **curv)


def _assemble(batch_size: int, sums: dict[str, jax.Array], groups: tuple | None) -> NoiseStats:
    n1 = batch_size - 1
    curv = "dhd" in sums
    group_stats = None
    if groups is not None:
        names, matrix_LxK, _ = groups
        gsq_K = sums["gsq_L"] @ matrix_LxK
        centred_K = sums["centred_L"] @ matrix_LxK
        group_stats = {
            name: _make_stats(batch_size, gsq_K[k], centred_K[k] / n1,
                              sums["ghg_K"][k] if curv else None,
                              sums["dhd_K"][k] / n1 if curv else None)
            for k, name in enumerate(names)}
    return _make_stats(batch_size, jnp.sum(sums["gsq_L"]), jnp.sum(sums["centred_L"]) / n1,
                       sums.get("ghg"), sums["dhd"] / n1 if curv else None, group_stats)


def _vmap_sums(loss_fn, params, batch, chunk_size, curvature, blocks, hessian_batch=None):
    """Centred sums from per-example gradients, in chunks (H of `hessian_batch`, else `batch`)."""
    dtype = trees.accum_dtype()
    grad, hvp_lin = _grad_and_hvp(loss_fn, params, batch, hessian_batch, curvature)
    chunk_size = ghost.vmap_chunk_size(params, batch, chunk_size)
    grad_acc = trees.tree_cast(grad, dtype)

    def per_example(example):
        g = jax.grad(loss_fn)(params, examples.one_example(example))
        d = jax.tree.map(jnp.subtract, trees.tree_cast(g, dtype), grad_acc)
        out: dict[str, jax.Array | None] = {"centred_L": jnp.stack(trees.leaf_dots(d, d))}
        if curvature:
            out["dhd"], out["dhd_K"] = block_quadratic_forms(hvp_lin, d, blocks)  # K: or None
        return out

    sums = jax.tree.map(lambda x: jnp.sum(x, axis=0),
                        examples.map_examples(per_example, batch, chunk_size))
    sums["gsq_L"] = jnp.stack(trees.leaf_dots(grad, grad))
    if curvature:
        sums["ghg"], sums["ghg_K"] = block_quadratic_forms(hvp_lin, grad, blocks)
    return sums


def _grad_and_hvp(loss_fn, params, batch, hessian_batch, curvature=True):
    """(ḡ of `batch`, v ↦ Hv) with H of `hessian_batch` (None: of `batch` itself); without
    `curvature`, (ḡ, None)."""
    if curvature and hessian_batch is None:
        return hvp_fn(loss_fn, params, batch)
    return jax.grad(loss_fn)(params, batch), (
        hvp_fn(loss_fn, params, hessian_batch)[1] if curvature else None)


def _fast_sums(batch_size, grad, sq_norms):
    # Σ_i |g_i − ḡ|² = Σ_i |g_i|² − B|ḡ|² subtracts two nearly equal numbers when the signal
    # dominates: the relative error of trace_sigma is about ε·(1 + B/b_simple), with ε the
    # float32 (or float64) epsilon. The vmap route centres first and does not have this loss.
    dtype = trees.accum_dtype()
    sq_L = jnp.stack([jnp.sum(x.astype(dtype)) for x in jax.tree.leaves(sq_norms)])
    gsq_L = jnp.stack(trees.leaf_dots(grad, grad))
    return {"gsq_L": gsq_L, "centred_L": sq_L - batch_size * gsq_L}


def exact(loss_fn: LossFn, params: PyTree, batch: PyTree, *, chunk_size: int | None = None,
          curvature: bool = False, groups: GroupSpec = None, method: str = "auto",
          hessian_batch: PyTree | None = None) -> NoiseStats:
    """Exact noise statistics of one batch (B ≥ 2, may be sharded) from per-example gradients,
    scalars in `cbs.stats.trees.accum_dtype()`.

    Args:
        loss_fn: loss_fn(params, batch) -> scalar MEAN loss over the batch's leading axis.
        chunk_size: examples per vmap chunk; None: from `cbs.stats.ghost.MEMORY_BUDGET_BYTES`.
        curvature: also the curvature fields (one HVP per example: cost O(B²)).
        groups: per-parameter-group breakdown (`cbs.stats.trees.resolve_groups`); a group's
            curvature terms use its diagonal block H_kk of H, so only its trace_sigma and |ḡ|²
            sum to the total.
        method: as in `cbs.stats.ghost.per_example_grads_info` ("vmap" centres each g_i on ḡ
            before squaring); curvature=True takes the vmap route.
        hessian_batch: examples independent of `batch` whose mean-loss Hessian is H (curvature
            only: unbiased trace_h_sigma and g_h_g). None: H of `batch` (biased high for small B).
    """
    check_inputs(loss_fn, params, batch)
    _check_method(method)
    return _exact(loss_fn, params, batch, hessian_batch, chunk_size=chunk_size,
                  curvature=curvature, groups=groups, method=method)


def _check_method(method: str) -> None:
    if method not in ("auto", "vmap", "fast"):
        raise ValueError(f"method must be 'auto', 'vmap' or 'fast', got {method!r}.")


@examples.jit_per_settings
def _exact(loss_fn, params, batch, hessian_batch, *, chunk_size, curvature, groups, method
           ) -> NoiseStats:
    batch_size = jax.tree.leaves(batch)[0].shape[0]
    grouping = group_matrix(params, groups)
    blocks = grouping[2] if grouping else None

    def compute(params, batch, hessian_batch):
        if method == "vmap" or curvature:
            sums = _vmap_sums(loss_fn, params, batch, chunk_size, curvature, blocks, hessian_batch)
        else:
            sums = _fast_sums(batch_size, *ghost.per_example_grads_info(
                loss_fn, params, batch, method=method, chunk_size=chunk_size)[1:])
        return _assemble(batch_size, sums, grouping)

    return run_auto_axes(compute, params, batch, hessian_batch)


def per_example_sq_norms(loss_fn: LossFn, params: PyTree, batch: PyTree, *, method: str = "auto",
                         chunk_size: int | None = None) -> jax.Array:
    """|g_i|² for every example, [B] (float32, float64 under x64); method as in `exact`."""
    check_inputs(loss_fn, params, batch, min_batch=1)
    _check_method(method)
    return _per_example_sq_norms(loss_fn, params, batch, method=method, chunk_size=chunk_size)


@examples.jit_per_settings
def _per_example_sq_norms(loss_fn, params, batch, *, method, chunk_size) -> jax.Array:
    def compute(params, batch):
        if method != "vmap":
            _, _, sq_norms = ghost.per_example_grads_info(loss_fn, params, batch, method=method,
                                                          chunk_size=chunk_size)
            dtype = trees.accum_dtype()
            return sum(x.astype(dtype) for x in jax.tree.leaves(sq_norms))
        per_example = lambda ex: trees.tree_sq_norm(
            jax.grad(loss_fn)(params, examples.one_example(ex)))
        chunk = ghost.vmap_chunk_size(params, batch, chunk_size)
        return examples.map_examples(per_example, batch, chunk)

    return run_auto_axes(compute, params, batch)


def _probe_vector(key: jax.Array, params: PyTree, distribution: str) -> PyTree:
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    draw = {"rademacher": jax.random.rademacher, "gaussian": jax.random.normal}[distribution]
    return jax.tree.unflatten(treedef, [draw(k, x.shape, x.dtype)
                                        for k, x in zip(keys, leaves, strict=True)])


def probe(loss_fn: LossFn, params: PyTree, batch: PyTree, key: jax.Array, *,
          num_probes: int = 1, curvature: bool = False,
          distribution: str = "rademacher", hessian_batch: PyTree | None = None) -> NoiseStats:
    """Hutchinson estimates of trace_sigma (and trace_h_sigma); memory O(params).

    For a probe z with E[zzᵀ] = I, a_i = zᵀg_i (all i in one forward-mode pass over the
    per-example losses) and d_i = g_i − ḡ give a_i − ā = zᵀd_i, E_z[(zᵀd_i)²] = |d_i|² and

        trace_sigma ≈ Σ_i (a_i − ā)² / (B − 1).

    Curvature: with u = Hz (one HVP) and b_i = uᵀg_i, E_z[(zᵀd_i)(uᵀd_i)] = d_iᵀ H d_i, so

        trace_h_sigma ≈ Σ_i (a_i − ā)(b_i − b̄) / (B − 1).

    Both are exactly unbiased given the batch, averaged over `num_probes` probes (one after
    another); |ḡ|² and ḡᵀHḡ are exact. `distribution`: "rademacher" (lower variance) or
    "gaussian"; `hessian_batch` as in `exact`.
    """
    check_inputs(loss_fn, params, batch)
    if distribution not in ("rademacher", "gaussian"):
        raise ValueError(f"distribution must be 'rademacher' or 'gaussian', got {distribution!r}.")
    if num_probes < 1:
        raise ValueError(f"num_probes must be at least 1, got {num_probes}.")
    return _probe(loss_fn, params, batch, key, hessian_batch, num_probes=num_probes,
                  curvature=curvature, distribution=distribution)


@examples.jit_per_settings
def _probe(loss_fn, params, batch, key, hessian_batch, *, num_probes, curvature, distribution
           ) -> NoiseStats:
    batch_size = jax.tree.leaves(batch)[0].shape[0]
    dtype = trees.accum_dtype()

    def compute(params, batch, key, hessian_batch):
        grad, hvp_lin = _grad_and_hvp(loss_fn, params, batch, hessian_batch, curvature)
        mean_ghg = trees.tree_dot(grad, hvp_lin(grad)) if curvature else None
        losses_B = lambda p: jax.vmap(lambda ex: loss_fn(p, examples.one_example(ex)))(batch)
        _, jvp_lin = jax.linearize(losses_B, params)
        centred = lambda v: (lambda a_B: a_B - jnp.mean(a_B))(jvp_lin(v).astype(dtype))

        def one_probe(k):
            z = _probe_vector(k, params, distribution)
            a_B = centred(z)
            est = {"trace_sigma": jnp.sum(a_B * a_B) / (batch_size - 1)}
            if curvature:
                b_B = centred(trees.tree_cast_like(hvp_lin(z), params))
                est["trace_h_sigma"] = jnp.sum(a_B * b_B) / (batch_size - 1)
            return est

        ests = jax.lax.map(one_probe, jax.random.split(key, num_probes))
        ests = jax.tree.map(lambda x: jnp.mean(x, axis=0), ests)
        return _make_stats(batch_size, trees.tree_sq_norm(grad), ests["trace_sigma"], mean_ghg,
                           ests.get("trace_h_sigma"))

    return run_auto_axes(compute, params, batch, key, hessian_batch)


# A measurement method (`register_method`), jittable: the train step calls it under its jit.
MethodFn = Callable[..., NoiseStats]
# The keywords a method may declare it takes besides the common ones (`register_method`).
METHOD_ARGUMENTS = ("hessian_batch", "deviations", "hessian_examples")
_METHODS: dict[str, MethodFn] = {}
_ARGUMENTS: dict[str, tuple[str, ...]] = {}


def register_method(name: str, fn: MethodFn, *, takes: Sequence[str] = ()) -> MethodFn:
    """Registers fn as the noise method `name` (a value of `config.noise.method`); returns fn.

    fn(loss_fn, params, batch, *, key, curvature, num_probes, chunk_size) -> NoiseStats: key a fresh
    PRNG key, num_probes / chunk_size the config's (None for 0). `takes`: the further keywords it
    is given (`METHOD_ARGUMENTS`): `hessian_batch`, examples for H independent of the measured
    ones; `deviations` and `hessian_examples`, the config's m and h."""
    if name in _METHODS:
        raise ValueError(f"noise method {name!r} is already registered")
    if unknown := set(takes) - set(METHOD_ARGUMENTS):
        raise ValueError(f"noise method {name!r}: unknown arguments {sorted(unknown)}; a "
                         f"method may take {METHOD_ARGUMENTS}")
    _METHODS[name], _ARGUMENTS[name] = fn, tuple(takes)
    return fn


def method_arguments(name: str) -> tuple[str, ...]:
    """The `takes` of the method `name` (`register_method`)."""
    get_method(name)
    return _ARGUMENTS[name]


def method_names() -> tuple[str, ...]:
    """Registered method names, in registration order."""
    return tuple(_METHODS)


def get_method(name: str) -> MethodFn:
    """The method registered as `name`; ValueError listing the known names otherwise."""
    if name not in _METHODS:
        raise ValueError(f"noise.method: unknown method {name!r}; known: {list(_METHODS)}")
    return _METHODS[name]


def _exact_method(route: str) -> MethodFn:
    def measure(loss_fn, params, batch, *, key, curvature, num_probes, chunk_size,
                hessian_batch=None):
        del key, num_probes
        return exact(loss_fn, params, batch, chunk_size=chunk_size, curvature=curvature,
                     method=route, hessian_batch=hessian_batch if curvature else None)

    return measure


def _probe_method(loss_fn, params, batch, *, key, curvature, num_probes, chunk_size,
                  hessian_batch=None):
    del chunk_size
    return probe(loss_fn, params, batch, key, num_probes=num_probes, curvature=curvature,
                 hessian_batch=hessian_batch)


for _route in ("auto", "fast", "vmap"):
    register_method(_route, _exact_method(_route), takes=("hessian_batch",))
register_method("probe", _probe_method, takes=("hessian_batch",))
