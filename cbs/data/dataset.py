"""The `Dataset` record and the views that turn stored arrays into batches.

Letters: B batch, N examples in a split, T sequence length, C classes, V vocabulary.

A split stores compact arrays (uint8 images, a 1-D token array) and a pure *view* turns them
plus example indices (numpy, or jax inside jit) into a batch: classification {"x": float32
[B, ...], "y": int32 [B]} (float32 [B, C] when one-hot), language modelling {"x": int32
[B, T], "y": int32 [B, T]} with y = x shifted by one, regression {"x": float32 [B, D], "y":
float32 [B]}. Splits too large for memory have a host `reader` instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [  # and `Dataset`, public as cbs.data.Dataset
    "TASKS", "Batch", "ClassificationView", "RegressionView", "Split", "WindowView", "num_windows",
]

Batch = dict[str, Any]
TASKS = ("classification", "lm", "regression")


def _xp(*arrays):
    return np if all(isinstance(a, np.ndarray | np.generic) for a in arrays) else jnp


def _gather(xp, stored, idx):
    return (stored if xp is np else jnp.asarray(stored))[idx]


@dataclasses.dataclass(frozen=True)
class ClassificationView:
    """x = (stored_x * scale - mean) / std as float32 (optionally flattened); y int32 labels."""

    num_classes: int
    scale: float = 1.0
    mean: tuple[float, ...] | float = 0.0
    std: tuple[float, ...] | float = 1.0
    flatten: bool = False
    one_hot: bool = False

    def __call__(self, arrays: Mapping[str, Any], idx_B) -> Batch:
        xp = _xp(arrays["x"], idx_B)
        x = _gather(xp, arrays["x"], idx_B).astype(xp.float32) * xp.float32(self.scale)
        if self.mean != 0.0 or self.std != 1.0:
            x = (x - xp.asarray(self.mean, xp.float32)) / xp.asarray(self.std, xp.float32)
        if self.flatten:
            x = x.reshape(x.shape[0], -1)
        y = _gather(xp, arrays["y"], idx_B).astype(xp.int32)
        if self.one_hot:
            y = (y[:, None] == xp.arange(self.num_classes)).astype(xp.float32)
        return {"x": x, "y": y}


@dataclasses.dataclass(frozen=True)
class RegressionView:
    """x float32 [B, D], y float32 [B], gathered as stored."""

    def __call__(self, arrays: Mapping[str, Any], idx_B) -> Batch:
        xp = _xp(arrays["x"], idx_B)
        return {"x": _gather(xp, arrays["x"], idx_B).astype(xp.float32),
                "y": _gather(xp, arrays["y"], idx_B).astype(xp.float32)}


@dataclasses.dataclass(frozen=True)
class WindowView:
    """Example i is tokens[i*stride : i*stride + T + 1]; x = its first T, y = its last T."""

    seq_len: int
    stride: int

    def __call__(self, arrays: Mapping[str, Any], idx_B) -> Batch:
        xp = _xp(arrays["tokens"], idx_B)
        starts_B = idx_B.astype(xp.int32 if xp is jnp else np.int64) * self.stride
        window_BxT1 = _gather(xp, arrays["tokens"], starts_B[:, None] + xp.arange(self.seq_len + 1))
        window_BxT1 = window_BxT1.astype(xp.int32)
        return {"x": window_BxT1[:, :-1], "y": window_BxT1[:, 1:]}


def num_windows(num_tokens: int, seq_len: int, stride: int, what: str) -> int:
    """Number of length-(T+1) windows at the given stride; ValueError if T does not fit."""
    if seq_len < 1 or stride < 1:
        raise ValueError(f"seq_len and stride must be >= 1, got {seq_len}, {stride}")
    if num_tokens < seq_len + 1:
        raise ValueError(
            f"seq_len={seq_len} is too long for {what}: it has {num_tokens} tokens and a "
            f"window needs seq_len + 1 = {seq_len + 1}; use seq_len <= {num_tokens - 1}")
    return (num_tokens - seq_len - 1) // stride + 1


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """One split: N examples, stored `arrays` + pure `view`, or a host `reader` (streaming)."""

    num_examples: int
    view: Callable[[Mapping[str, Any], Any], Batch] | None
    arrays: dict[str, np.ndarray] | None = None
    reader: Callable[[np.ndarray], Batch] | None = None

    @property
    def in_memory(self) -> bool:
        return self.arrays is not None

    def read(self, idx_B: np.ndarray) -> Batch:
        """Host batch (numpy) of the examples `idx_B`."""
        idx_B = np.asarray(idx_B, np.int64)
        if self.arrays is not None:
            return cast(Callable, self.view)(self.arrays, idx_B)  # set with the arrays
        return cast(Callable, self.reader)(idx_B)  # set when there are no arrays


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A dataset from the registry (`cbs.data.get_dataset`): its `task` (TASKS), per-example
    `input_shape` of batch["x"] ([T] for lm), `splits` {"train", "eval"}, `num_classes`, the
    lm's `vocab_size`, `vocab` (characters; None for bytes) and `seq_len`, and `metadata`
    (sources, normalisation, closed-form answers of synthetic data)."""

    name: str
    task: str
    input_shape: tuple[int, ...]
    splits: dict[str, Split]
    num_classes: int | None = None
    vocab_size: int | None = None
    vocab: str | None = None
    seq_len: int | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")

    @property
    def train(self) -> dict[str, np.ndarray] | None:  # stored arrays; None when streamed
        return self.splits["train"].arrays

    @property
    def eval(self) -> dict[str, np.ndarray] | None:
        return self.splits["eval"].arrays

    @property
    def num_train(self) -> int:
        return self.splits["train"].num_examples

    @property
    def num_eval(self) -> int:
        return self.splits["eval"].num_examples

    def split(self, name: str) -> Split:
        if name not in self.splits:
            raise ValueError(f"{self.name} has splits {sorted(self.splits)}, not {name!r}")
        return self.splits[name]

    def in_memory(self, split: str = "train") -> bool:
        return self.split(split).in_memory

    def take(self, arrays: Mapping[str, Any], idx_B, split: str = "train") -> Batch:
        """Pure view: batch of examples `idx_B` from stored `arrays` (numpy or jax, jittable)."""
        view = self.split(split).view
        if view is None:
            raise ValueError(f"{self.name}/{split} is streamed: it has no array view")
        return view(arrays, idx_B)

    def device_arrays(self, split: str = "train",
                      sharding: jax.sharding.Sharding | None = None) -> dict[str, jax.Array]:
        """Stored arrays of `split` on device (replicated by `sharding` when given)."""
        arrays = self.split(split).arrays
        if arrays is None:
            raise ValueError(f"{self.name}/{split} is streamed, not in memory: use the host "
                             "path (cbs.data.batching.host_batch / cbs.data.HostLoader)")
        if sharding is None:
            return {k: jnp.asarray(v) for k, v in arrays.items()}
        return {k: jax.make_array_from_process_local_data(sharding, v, v.shape)
                for k, v in arrays.items()}

    def encode(self, text: str) -> np.ndarray:
        """Token ids int32 of `text` (char vocab, or UTF-8 bytes when vocab is None)."""
        if self.task != "lm":
            raise ValueError(f"{self.name} is not a language-modelling dataset")
        if self.vocab is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        lookup = {c: i for i, c in enumerate(self.vocab)}
        missing = sorted(set(text) - set(lookup))
        if missing:
            raise ValueError(f"characters not in the {self.name} vocabulary: {missing}")
        return np.array([lookup[c] for c in text], np.int32)

    def decode(self, tokens) -> str:
        """Text of a 1-D sequence of token ids."""
        if self.task != "lm":
            raise ValueError(f"{self.name} is not a language-modelling dataset")
        ids = np.asarray(tokens).astype(np.int64).ravel()
        if self.vocab is None:
            return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")
        return "".join(self.vocab[i] for i in ids)
