"""Data for critical-batch-size experiments: a registry of datasets and deterministic batches.

Small datasets live on device and the jitted step gathers its own batch:

    ds = cbs.data.get_dataset(config.data.name, **config.data.options)
    arrays = ds.device_arrays(sharding=replicated)          # once
    batch_fn = cbs.data.make_batch_fn(ds, seed=config.seed)
    # inside the jitted step (batch_size static, examples_seen an int32 scalar):
    batch = batch_fn(arrays, state.examples_seen, batch_size)

Large or streamed datasets come from the host, prefetched, as global sharded arrays:

    loader = cbs.data.HostLoader(ds, seed=config.seed, sharding=batch_sharding)
    batch = loader(examples_seen, batch_size)                # each process reads its rows

The global batch is a pure function of (seed, examples_seen, batch_size) (`cbs.data.stream`).

Modules: `dataset` (the `Dataset` type and its views), `stream` (the seeded example stream),
`batching` (device and host batches, evaluation), and the sources `embedded` (offline),
`synthetic` (known answers) and `tfds_source` (TensorFlow Datasets, prepared locally).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from cbs.data import embedded, synthetic, tfds_source
from cbs.data.batching import HostLoader, make_batch_fn
from cbs.data.dataset import Dataset
from cbs.data.synthetic import linreg_noise_stats

_REGISTRY: dict[str, Callable[..., Dataset]] = {
    "digits": embedded.digits,
    "mnist1d": embedded.mnist1d,
    "shakespeare_char": embedded.shakespeare_char,
    "linreg": synthetic.linreg,
    "teacher_student": synthetic.teacher_student,
    "teacher_regression": synthetic.teacher_regression,
    **{name: functools.partial(tfds_source.tfds_images, name)
       for name in tfds_source.IMAGE_DATASETS},
    "tiny_shakespeare": tfds_source.tiny_shakespeare,
    "lm1b": tfds_source.lm1b,
}


def known_datasets() -> tuple[str, ...]:
    """Registered dataset names."""
    return tuple(sorted(_REGISTRY))


def register(name: str, loader: Callable[..., Dataset]) -> None:
    """Adds a loader `loader(**options) -> Dataset` under `name`."""
    if name in _REGISTRY:
        raise ValueError(f"dataset {name!r} is already registered")
    _REGISTRY[name] = loader


def dataset_options(name: str) -> tuple[str, ...]:
    """Keyword options that `get_dataset(name, ...)` accepts."""
    params = inspect.signature(_loader(name)).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def _loader(name: str) -> Callable[..., Dataset]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(known_datasets())}")
    return _REGISTRY[name]


def _check_options(name: str, options, field: str = "") -> None:
    """ValueError (prefixed by `field`) naming the options the loader of `name` does not take."""
    params = inspect.signature(_loader(name)).parameters.values()
    unknown = sorted(set(options) - set(dataset_options(name)))
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise ValueError(f"{field}unknown options {unknown} for dataset {name!r}; known: "
                         f"{', '.join(dataset_options(name)) or 'none'}")


def validate_config(data_config: Any) -> None:
    """Checks `config.data` (a registered `name`, `options` the loader accepts) without
    loading; the ValueError's message starts with the field's dotted name."""
    name = data_config.get("name") if hasattr(data_config, "get") else None
    if name not in _REGISTRY:
        raise ValueError(f"config.data.name: unknown dataset {name!r}; known: "
                         f"{', '.join(known_datasets())}")
    options = data_config.get("options") or {}
    if not hasattr(options, "keys"):
        raise ValueError(f"config.data.options: must be a mapping of keyword options, got "
                         f"{options!r}")
    _check_options(name, options.keys(), "config.data.options: ")


def get_dataset(name: str, **options) -> Dataset:
    """The dataset `name` built with `options` (ValueError for unknown names or options)."""
    _check_options(name, options)
    return _loader(name)(**options)


__all__ = [  # what it defines, and the four names of its modules that users take from here
    "Dataset", "HostLoader", "dataset_options", "get_dataset", "known_datasets",
    "linreg_noise_stats", "make_batch_fn", "register", "validate_config",
]
