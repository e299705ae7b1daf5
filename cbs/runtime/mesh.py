"""Device mesh and shardings: batch on the "data" axis, parameters replicated or sharded.

A mesh has axes ("data", "model") of sizes (R, M) over R·M global devices. A global batch
[B, ...] is split along its leading axis into R equal parts; parameters are replicated or
sharded over "model" (FSDP-style or column-parallel).

Axis types are `AxisType.Auto`, so jit propagates the input shardings and models, losses and
statistics need no sharding annotations (with `Explicit`, the embedding gather from a sharded
table and the micro-batch reshape of the batch axis raise ShardingTypeError under jit).

Named rules (`param_mode` "fsdp_tp" or "tp", `LM_RULES`): a parameter's path (`blocks/wq`,
or `0/mu/blocks/wq` for its optimizer moment) picks the roles of its trailing axes: "fsdp" is
sharded over "data" (each replica holds 1/R of the parameter and optimizer state), "tp" over
"model" (Megatron column/row split). Leading axes (the layer axis of scanned blocks) and axes
the mesh axis does not divide stay whole; unmatched leaves are replicated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cbs.runtime import fields

__all__ = [
    "LM_RULES", "MODEL", "PARAM_MODES", "batch_sharding", "data_replicas", "global_batch",
    "make_mesh", "named_spec", "param_shardings", "path_name", "replicated", "shard",
    "validate_config",
]

_DATA, MODEL = "data", "model"
PARAM_MODES = ("replicated", "fsdp", "model")
_NAMED_MODES = ("fsdp_tp", "tp")  # by parameter name (LM_RULES): FSDP over data × TP, TP only
_ALL_PARAM_MODES = PARAM_MODES + _NAMED_MODES


def validate_config(mesh_config: Any) -> None:
    """Checks `config.mesh` (data, model, param_mode); raises `fields.ConfigError`."""
    data = fields.get(mesh_config, "data", "config.mesh")
    if isinstance(data, bool) or not isinstance(data, int) or (data < 1 and data != -1):
        raise fields.ConfigError(f"config.mesh.data: must be -1 or a positive integer, got "
                                 f"{data!r}")
    fields.integer(mesh_config, "model", "config.mesh")
    fields.choice(mesh_config, "param_mode", "config.mesh", _ALL_PARAM_MODES)

# (regex on the "/"-joined path, roles of the trailing axes); first match wins.
_Rules = tuple[tuple[str, tuple[str | None, ...]], ...]
LM_RULES: _Rules = (
    (r"(^|/)embed$", ("tp", "fsdp")),  # [V, D]: vocabulary over model
    (r"(^|/)head$", ("fsdp", "tp")),  # [D, V]
    (r"(^|/)(wq|wk|wv|w_gate|w_up)$", ("fsdp", "tp")),  # [D, O]: column parallel
    (r"(^|/)(wo|w_down)$", ("tp", "fsdp")),  # [O, D]: row parallel
    (r"norm$", (None,)),  # [D]: replicated
)


def make_mesh(data: int = -1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The (R, M) = (data, model) mesh (data -1: all devices not used by `model`); R·M must
    equal the number of `devices` (default: all global devices)."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if model < 1 or n % model:
        raise ValueError(f"mesh.model={model} must be a positive divisor of {n} devices")
    if data == -1:
        data = n // model
    if data < 1 or data * model != n:
        raise ValueError(f"mesh.data={data} × mesh.model={model} must equal the {n} devices "
                         "(pass devices= to use fewer)")
    return jax.make_mesh((data, model), (_DATA, MODEL), axis_types=(AxisType.Auto,) * 2,
                         devices=devices)


def data_replicas(mesh: Mesh) -> int:
    """Number of data-parallel replicas R (size of the "data" axis)."""
    return mesh.shape[_DATA]


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over "data", other axes replicated."""
    return NamedSharding(mesh, P(_DATA))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, P())


def _leaf_spec(shape: tuple[int, ...], mode: str, m: int, min_size: int) -> P:
    if mode == "replicated" or m == 1:
        return P()
    if mode == "model":
        # Column-parallel: the output-feature (last) axis of kernels and tables.
        ok = len(shape) >= 2 and shape[-1] % m == 0
        return P(*(None,) * (len(shape) - 1), MODEL) if ok else P()
    divisible = [i for i, n in enumerate(shape) if n % m == 0]
    if math.prod(shape) < min_size or not divisible:
        return P()
    axis = max(divisible, key=lambda i: shape[i])  # first of the largest on ties
    return P(*(MODEL if i == axis else None for i in range(len(shape))))


def param_shardings(params: Any, mesh: Mesh, mode: str = "replicated", *,
                    min_size: int = 2**14, rules: _Rules = LM_RULES) -> Any:
    """A pytree like `params` (arrays or jax.ShapeDtypeStruct) of NamedShardings, by `mode`:
    "replicated"; "fsdp" (leaves of at least `min_size` elements split over "model" along
    their largest axis divisible by M); "model" (leaves of rank >= 2 along their last axis
    when divisible by M); "fsdp_tp" / "tp" (by name, `rules`, with / without FSDP). A leaf
    that cannot be split stays replicated."""
    if mode not in _ALL_PARAM_MODES:
        raise ValueError(f"mesh.param_mode={mode!r} is not one of {_ALL_PARAM_MODES}")
    if mode in _NAMED_MODES:
        return jax.tree_util.tree_map_with_path(
            lambda path, x: NamedSharding(mesh, named_spec(path_name(path), tuple(x.shape), mesh,
                                                           rules, fsdp=mode == "fsdp_tp")), params)
    m = mesh.shape[MODEL]
    return jax.tree.map(
        lambda x: NamedSharding(mesh, _leaf_spec(tuple(x.shape), mode, m, min_size)), params)


def path_name(path: tuple) -> str:
    """"blocks/wq" from a pytree key path (nnx Variable `.value` keys dropped)."""
    names = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return "/".join(str(name) for name in names if name != "value")


def named_spec(name: str, shape: tuple[int, ...], mesh: Mesh, rules: _Rules = LM_RULES, *,
               fsdp: bool = True) -> P:
    """PartitionSpec of the leaf called `name` (see the module docstring)."""
    axis = {"fsdp": _DATA if fsdp else None, "tp": MODEL, None: None}
    for pattern, roles in rules:
        if re.search(pattern, name):
            if len(roles) > len(shape):
                raise ValueError(f"sharding rule {pattern!r} names {len(roles)} axes; "
                                 f"parameter {name} has shape {shape}")
            axes = [axis[r] for r in (None,) * (len(shape) - len(roles)) + tuple(roles)]
            return P(*(a if a is not None and n % mesh.shape[a] == 0 else None
                       for n, a in zip(shape, axes, strict=True)))
    return P()


def shard(tree: Any, shardings: Any) -> Any:
    """jax.device_put(tree, shardings) (one sharding or a matching pytree); on several hosts
    every process must pass the same values (`global_batch` for data that differs)."""
    return jax.device_put(tree, shardings)


def global_batch(local_batch: Any, mesh: Mesh) -> Any:
    """Global arrays split over "data" [B, ...] from each of P processes' [B / P, ...] slice
    (one process: `shard(local_batch, batch_sharding(mesh))`)."""
    sharding = batch_sharding(mesh)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local_batch)
