"""Batches from the example stream: on device (jit), on the host with prefetch, multi-host.

Letters: s examples seen (stream position), B global batch size, N examples in the split.

The global batch at (seed, s, B) is stream positions [s, s + B) (`cbs.data.stream`); every
function here returns exactly that batch, or the rows of it that a process holds.
`eval_batches` and `evaluate` read a split in order from its first example.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cbs.data.dataset import Batch, Dataset
from cbs.data.stream import check_batch_size, positions_to_indices_np, stream_indices_jax

__all__ = [  # and, public as cbs.data.HostLoader and cbs.data.make_batch_fn, those two
    "device_batch", "eval_batches", "evaluate", "global_batch", "host_batch", "process_rows",
]


def device_batch(dataset: Dataset, arrays: dict[str, jax.Array], examples_seen, batch_size: int,
                 *, seed, split: str = "train", shuffle: bool = True) -> Batch:
    """The global batch gathered from device-resident `arrays`; jittable in `arrays`,
    `examples_seen` (int32 scalar) and `seed`, `batch_size` static."""
    num = dataset.split(split).num_examples
    check_batch_size(batch_size, num, f"{dataset.name}/{split}")
    idx_B = stream_indices_jax(examples_seen, batch_size, num, seed, shuffle=shuffle)
    return dataset.take(arrays, idx_B, split)


def make_batch_fn(dataset: Dataset, *, seed, split: str = "train", shuffle: bool = True
                  ) -> Callable[[dict[str, jax.Array], Any, int], Batch]:
    """`batch_fn(arrays, examples_seen, batch_size)`: `device_batch` with the dataset bound."""
    return functools.partial(device_batch, dataset, seed=seed, split=split, shuffle=shuffle)


def host_batch(dataset: Dataset, examples_seen: int, batch_size: int, *, seed: int,
               split: str = "train", rows: np.ndarray | slice | None = None,
               shuffle: bool = True) -> Batch:
    """Numpy rows `rows` (default all) of the global batch."""
    num = dataset.split(split).num_examples
    check_batch_size(batch_size, num, f"{dataset.name}/{split}")
    rows_R = np.arange(batch_size)[rows if rows is not None else slice(None)]
    idx_R = positions_to_indices_np(int(examples_seen) + rows_R, num, seed, shuffle=shuffle)
    return dataset.split(split).read(idx_R)


def process_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> np.ndarray:
    """Sorted global batch rows held by this process's devices under `sharding` (the
    process-local data of `jax.make_array_from_process_local_data`)."""
    if global_shape[0] % (shards := _data_shards(sharding, global_shape)):
        raise ValueError(f"batch_size={global_shape[0]} is not divisible by the {shards} "
                         "shards of the batch axis")
    indices = sharding.addressable_devices_indices_map(global_shape).values()
    # jax types the indices as optional; a device of the sharding always has one
    rows = {r for index in indices for r in range(global_shape[0])[index[0]]}  # type: ignore[index]
    return np.array(sorted(rows), np.int64)


def _data_shards(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> int:
    """How many pieces the sharding cuts the leading (batch) axis into."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,)
        axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
        return int(np.prod([sharding.mesh.shape[a] for a in axes if a is not None]))
    return global_shape[0] // sharding.shard_shape(global_shape)[0]


def global_batch(dataset: Dataset, sharding: jax.sharding.Sharding, examples_seen: int,
                 batch_size: int, *, seed: int, split: str = "train",
                 shuffle: bool = True) -> dict[str, jax.Array]:
    """The global batch as jax.Arrays sharded by `sharding`; each process reads its rows."""
    shape = (batch_size,) + tuple(dataset.input_shape)
    rows = process_rows(sharding, shape)
    local = host_batch(dataset, examples_seen, batch_size, seed=seed, split=split, rows=rows,
                       shuffle=shuffle)
    return {k: jax.make_array_from_process_local_data(sharding, v, (batch_size,) + v.shape[1:])
            for k, v in local.items()}


class HostLoader:
    """`loader(examples_seen, batch_size)`: `host_batch` (`global_batch` with `sharding`),
    prefetching the next `prefetch` batches, whose size stays or follows
    `batch_size_fn(examples_seen)`; a call that differs from the guess is read on the spot.
    """

    def __init__(self, dataset: Dataset, *, seed: int, split: str = "train",
                 sharding: jax.sharding.Sharding | None = None, prefetch: int = 2,
                 num_workers: int = 2, batch_size_fn: Callable[[int], int] | None = None,
                 rows: np.ndarray | slice | None = None, shuffle: bool = True):
        if sharding is not None and rows is not None:
            raise ValueError("give rows or sharding, not both")
        self._dataset, self._seed, self._split = dataset, seed, split
        self._sharding, self._rows, self._shuffle = sharding, rows, shuffle
        self._prefetch, self._batch_size_fn = prefetch, batch_size_fn
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, num_workers))
        self._pending: dict[tuple[int, int], concurrent.futures.Future] = {}

    def _read(self, examples_seen: int, batch_size: int):
        if self._sharding is not None:
            return global_batch(self._dataset, self._sharding, examples_seen, batch_size,
                                seed=self._seed, split=self._split, shuffle=self._shuffle)
        return host_batch(self._dataset, examples_seen, batch_size, seed=self._seed,
                          split=self._split, rows=self._rows, shuffle=self._shuffle)

    def __call__(self, examples_seen: int, batch_size: int) -> Batch:
        key = (int(examples_seen), int(batch_size))
        future = self._pending.pop(key, None)
        if future is None:
            check_batch_size(batch_size, self._dataset.split(self._split).num_examples)
            future = self._pool.submit(self._read, *key)
        wanted, s, b = [], key[0], key[1]
        for _ in range(self._prefetch):
            s += b
            b = self._batch_size_fn(s) if self._batch_size_fn is not None else b
            wanted.append((s, b))
        for stale in set(self._pending) - set(wanted):
            self._pending.pop(stale).cancel()
        for k in wanted:
            if k not in self._pending:
                self._pending[k] = self._pool.submit(self._read, *k)
        return future.result()

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> HostLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def eval_batches(dataset: Dataset, batch_size: int, *, split: str = "eval",
                 limit: int | None = None) -> Iterator[Batch]:
    """Numpy batches of examples 0, 1, ..., min(N, limit) - 1 in order (last one shorter)."""
    num = dataset.split(split).num_examples
    n = num if limit is None else min(limit, num)
    for start in range(0, n, batch_size):
        yield dataset.split(split).read(np.arange(start, min(start + batch_size, n)))


def _weighted(value, weight: int) -> jax.Array:
    return jnp.asarray(value, jnp.float32) * weight


def evaluate(metric_fn: Callable[[Batch], Any], dataset: Dataset, *, batch_size: int = 1024,
             split: str = "eval", limit: int | None = None,
             arrays: dict[str, jax.Array] | None = None) -> Any:
    """Example-weighted mean of `metric_fn(batch)` (batch means: a scalar or a pytree of
    scalars) over a split in fixed chunks, as Python floats. With `arrays` (the split on
    device, `dataset.device_arrays(split)`) chunks are gathered on device."""
    num = dataset.split(split).num_examples
    n = num if limit is None else min(limit, num)
    if n < 1:
        raise ValueError(f"nothing to evaluate in {dataset.name}/{split}")
    take = jax.jit(lambda a, idx: dataset.take(a, idx, split)) if arrays is not None else None
    total = None
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        batch = (take(arrays, jnp.asarray(idx, jnp.int32)) if take is not None
                 else dataset.split(split).read(idx))
        value = jax.tree.map(functools.partial(_weighted, weight=len(idx)), metric_fn(batch))
        total = value if total is None else jax.tree.map(jnp.add, total, value)
    return jax.tree.map(lambda t: float(t) / n, total)
