"""Embedded datasets that need no download: digits (scikit-learn's 8x8 handwritten digits),
mnist1d (Greydanus 2020, generated offline by the `mnist1d` package) and shakespeare_char (the
38 plays, public domain, shipped compressed; the first 90% of the text trains).

Letters: N examples, D features, T sequence length, V vocabulary size.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import json
import lzma
import os
import random

import numpy as np

from cbs.data.dataset import ClassificationView, Dataset, Split, WindowView, num_windows
from cbs.results.extras import install_command

__all__ = [
    "char_lm", "digits", "mnist1d", "shakespeare_char", "shakespeare_plays", "shakespeare_text",
]


def _eval_count(num_examples: int, eval_fraction: float) -> int:
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    return max(1, int(round(num_examples * eval_fraction)))


def _classification(name: str, x_train, y_train, x_eval, y_eval, *, num_classes: int,
                    flatten: bool, one_hot: bool, image_shape: tuple[int, ...] | None = None,
                    metadata: dict | None = None) -> Dataset:
    if image_shape is not None and not flatten:
        x_train = x_train.reshape((-1,) + image_shape)
        x_eval = x_eval.reshape((-1,) + image_shape)
    view = ClassificationView(num_classes=num_classes, one_hot=one_hot)
    splits = {"train": Split(len(y_train), view, {"x": x_train, "y": y_train}),
              "eval": Split(len(y_eval), view, {"x": x_eval, "y": y_eval})}
    return Dataset(name=name, task="classification", input_shape=tuple(x_train.shape[1:]),
                   splits=splits, num_classes=num_classes, metadata=metadata or {})


def digits(*, split_seed: int = 0, eval_fraction: float = 0.2, flatten: bool = True,
           one_hot: bool = False) -> Dataset:
    """scikit-learn digits: x float32 [N, 64] in [0, 1] ([N, 8, 8, 1] if not flatten);
    1,438 train / 359 eval examples by default, split by `split_seed`."""
    pixels, labels = _digits_arrays()
    x = (pixels / 16.0).astype(np.float32)
    y = labels.astype(np.int32)
    order = np.random.default_rng(split_seed).permutation(len(y))
    num_eval = _eval_count(len(y), eval_fraction)
    eval_idx, train_idx = order[:num_eval], order[num_eval:]
    return _classification("digits", x[train_idx], y[train_idx], x[eval_idx], y[eval_idx],
                           num_classes=10, flatten=flatten, one_hot=one_hot,
                           image_shape=(8, 8, 1), metadata={"split_seed": split_seed})


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(pixels float64 [1797, 64] in 0..16, labels [1797]) from scikit-learn's digits.csv.gz
    without importing scikit-learn (about 2 s), else `load_digits`."""
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = next((f for f in (os.path.join(d, "datasets", "data", "digits.csv.gz")
                             for d in folders) if os.path.exists(f)), None)
    if path is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.data, bunch.target
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def mnist1d(*, one_hot: bool = False, **dataset_args) -> Dataset:
    """MNIST-1D: x float32 [N, 40], 10 classes, 4,000 train / 1,000 eval by default;
    `dataset_args` override `mnist1d.data.get_dataset_args()`. Leaves the global RNGs be."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as err:
        raise ImportError("the mnist1d dataset needs the mnist1d package: "
                          f"{install_command('mnist1d')}") from err

    args = get_dataset_args(as_dict=True)
    unknown = sorted(set(dataset_args) - set(args))
    if unknown:
        raise ValueError(f"unknown mnist1d options {unknown}; known: {sorted(args)}")
    args.update(dataset_args)
    items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in args.items()))
    data = _make_mnist1d(items, make_dataset)
    return _classification(
        "mnist1d", data["x"].astype(np.float32), data["y"].astype(np.int32),
        data["x_test"].astype(np.float32), data["y_test"].astype(np.int32),
        num_classes=10, flatten=True, one_hot=one_hot, metadata={"mnist1d_args": args})


@functools.lru_cache(maxsize=4)
def _make_mnist1d(items: tuple, make_dataset) -> dict:
    from mnist1d.utils import ObjectView

    args = ObjectView({k: list(v) if isinstance(v, tuple) else v for k, v in items})
    np_state, py_state = np.random.get_state(), random.getstate()  # noqa: NPY002
    try:  # make_dataset seeds the global numpy / random generators
        return make_dataset(args)
    finally:
        np.random.set_state(np_state)  # noqa: NPY002
        random.setstate(py_state)


@functools.lru_cache(maxsize=1)
def shakespeare_plays() -> dict[str, str]:
    """{"genre/stem": plain text} of the 38 plays shipped with cbs, in path order (public
    domain; markup stripped, speakers as "NAME:")."""
    raw = importlib.resources.files("cbs.data").joinpath(
        "files/shakespeare_plays.json.xz").read_bytes()
    return json.loads(lzma.decompress(raw))


@functools.lru_cache(maxsize=4)
def shakespeare_text(plays: tuple[str, ...] | None = None) -> str:
    """Plain text of the plays (all 38 in path order, or those named by file stem)."""
    texts = shakespeare_plays()
    by_stem = {key.rsplit("/", 1)[1]: key for key in texts}
    unknown = sorted(set(plays or ()) - set(by_stem))
    if unknown:
        raise ValueError(f"unknown plays {unknown}; known: {sorted(by_stem)}")
    keys = list(texts) if plays is None else [by_stem[p] for p in plays]
    return "\n".join(texts[k] for k in keys)


def char_lm(name: str, train_text: str, eval_text: str, *, seq_len: int,
            stride: int | None, metadata: dict | None = None) -> Dataset:
    """Character-level LM dataset from two texts (vocabulary = sorted characters of both)."""
    vocab = "".join(sorted(set(train_text) | set(eval_text)))
    lookup = np.zeros(max(map(ord, vocab)) + 1, np.int32)
    lookup[[ord(c) for c in vocab]] = np.arange(len(vocab))
    dtype = np.uint8 if len(vocab) <= 256 else np.int32

    def encode(text: str) -> np.ndarray:
        return lookup[np.frombuffer(text.encode("utf-32-le"), np.uint32)].astype(dtype)

    stride = seq_len if stride is None else stride
    train_tokens, eval_tokens = encode(train_text), encode(eval_text)
    num_train = num_windows(len(train_tokens), seq_len, stride, f"{name} train")
    num_eval = num_windows(len(eval_tokens), seq_len, seq_len, f"{name} eval")
    splits = {"train": Split(num_train, WindowView(seq_len, stride), {"tokens": train_tokens}),
              "eval": Split(num_eval, WindowView(seq_len, seq_len), {"tokens": eval_tokens})}
    meta = {"stride": stride, "num_train_tokens": len(train_tokens),
            "num_eval_tokens": len(eval_tokens), **(metadata or {})}
    return Dataset(name=name, task="lm", input_shape=(seq_len,), splits=splits,
                   vocab_size=len(vocab), vocab=vocab, seq_len=seq_len, metadata=meta)


def shakespeare_char(*, seq_len: int = 128, stride: int | None = None, eval_fraction: float = 0.1,
                     plays: tuple[str, ...] | list[str] | None = None) -> Dataset:
    """Shakespeare's plays as characters: x, y int32 [B, seq_len]; train windows start every
    `stride` characters (default seq_len), eval windows do not overlap."""
    text = shakespeare_text(None if plays is None else tuple(plays))
    cut = len(text) - _eval_count(len(text), eval_fraction)
    return char_lm("shakespeare_char", text[:cut], text[cut:], seq_len=seq_len, stride=stride,
                   metadata={"plays": plays})
