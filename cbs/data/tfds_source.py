"""TensorFlow Datasets: mnist, fashion_mnist, cifar10, svhn_cropped, tiny_shakespeare, lm1b.

Letters: N examples, H×W×C images, T sequence length.

Reading prefers `tfds.data_source` (array_record files, random access, no TensorFlow);
`tfds.load` reads a TFRecord-only copy (or `reader="load"`). Nothing is downloaded unless
`download=True`: an unprepared dataset fails at once with the command that prepares it, and
a download without a reachable network fails within seconds with one line.

Images are stored uint8 [N, H, W, C]. lm1b is UTF-8 bytes (vocab 256), streamed: example i
is the first T + 1 bytes of the split's sentences i, i+1, ... joined by "\n" (wrapping at the
end), so every example is full length and each sentence starts one example per epoch.
"""

from __future__ import annotations

import logging
import os
import pathlib
import socket
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np

from cbs.data.dataset import ClassificationView, Dataset, Split
from cbs.data.embedded import char_lm
from cbs.results.extras import install_command

__all__ = ["IMAGE_DATASETS", "lm1b", "read_records", "tfds_images", "tiny_shakespeare"]

IMAGE_DATASETS = {"mnist": "test", "fashion_mnist": "test", "cifar10": "test",
                  "svhn_cropped": "test"}
_STATS_EXAMPLES = 10_000
_DOWNLOAD_HOST = "storage.googleapis.com"  # TFDS tries its prepared copies there first
_NETWORK_TIMEOUT_S = 5.0  # the network check gives up after this long


def _resolve_data_dir(data_dir: str | os.PathLike | None) -> str:
    """data_dir, else $TFDS_DATA_DIR, else ~/tensorflow_datasets (the TFDS default)."""
    if data_dir is None:
        data_dir = os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets")
    return str(pathlib.Path(data_dir).expanduser())


def _tfds():
    """The tensorflow_datasets module; an ImportError naming the extra when it is missing."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise ImportError("TFDS datasets need tensorflow_datasets: "
                          f"{install_command('tfds')}") from err
    return tfds


def _builder(name: str, data_dir: str | None, download: bool):
    """The TFDS builder, prepared (downloading only if asked); fails fast if unprepared."""
    tfds, data_dir = _tfds(), _resolve_data_dir(data_dir)
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(max(level, logging.ERROR))  # an unprepared copy logs warnings before our error
    try:
        builder = tfds.builder(name, data_dir=data_dir)  # reads local metadata only
        prepared = builder.is_prepared()
        looked = builder.data_dir
    finally:
        log.setLevel(level)
    if download:
        if not prepared:
            _check_network(name, data_dir, builder.download_and_prepare)
        builder.download_and_prepare(file_format="array_record")
    elif not prepared:
        raise FileNotFoundError(
            f"TFDS dataset {name!r} is not prepared in data_dir={data_dir} (looked for "
            f"{looked}); prepare it once on a machine with network access "
            f"(tfds build {name} --data_dir={data_dir} --file_format=array_record), or add "
            f"--config.data.options.download=True (download=True in get_dataset) to let cbs "
            f"download it, or set --config.data.options.data_dir (or $TFDS_DATA_DIR) to where "
            f"it is prepared")
    return builder


def _check_network(name: str, data_dir: str, download_fn=None) -> None:
    """Raises ConnectionError (one line) within _NETWORK_TIMEOUT_S when a download of `name`
    cannot reach the network; nothing is checked when `download_fn`, the download about to
    run, is not TFDS's own (`tfds.testing.mock_data`)."""
    if download_fn is not None and not getattr(download_fn, "__module__", "").startswith(
            "tensorflow_datasets.core"):
        return
    host, port = _DOWNLOAD_HOST, 443  # where a download connects first: the proxy, else GCS
    proxy = urllib.request.getproxies().get("https")
    if proxy and not urllib.request.proxy_bypass(_DOWNLOAD_HOST):
        parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = parts.hostname or _DOWNLOAD_HOST, parts.port or 80
    try:
        socket.create_connection((host, port), timeout=_NETWORK_TIMEOUT_S).close()
    except OSError as err:
        why = err.strerror or str(err) or type(err).__name__
        raise ConnectionError(
            f"cannot download TFDS dataset {name!r}: {host}:{port} is unreachable ({why}); "
            f"prepare it on a machine with network access (tfds build {name} "
            f"--file_format=array_record) and copy it into data_dir={data_dir}") from None


def _sources(builder, splits: Sequence[str], reader: str) -> dict:
    """split -> random-access source (data_source) or dict of numpy arrays (tfds.load)."""
    if reader not in ("auto", "data_source", "load"):
        raise ValueError(f"reader must be 'auto', 'data_source' or 'load', got {reader!r}")
    from tensorflow_datasets.core import file_adapters

    tfrecord = file_adapters.FileFormat.TFRECORD
    if reader == "load" or (reader == "auto" and builder.is_prepared()
                            and builder.info.file_format == tfrecord):
        try:
            import tensorflow  # noqa: F401
        except ImportError as err:
            why = "reader='load'" if reader == "load" else "its TFRecord files"
            raise ValueError(
                f"reading {builder.name} through tfds.load ({why}) needs TensorFlow: install "
                "tensorflow, or use reader='data_source' on files prepared with "
                "--file_format=array_record") from err
        tfds = _tfds()
        return {s: tfds.as_numpy(builder.as_dataset(split=s, batch_size=-1)) for s in splits}
    return {s: builder.as_data_source(split=s) for s in splits}


def read_records(source, indices: Sequence[int] | np.ndarray) -> list:
    """Records of a data source at `indices` (batched read when the source offers one)."""
    indices = [int(i) for i in indices]
    try:
        return list(source.__getitems__(indices))
    except (AttributeError, TypeError):
        return [source[i] for i in indices]


def _column(source, key: str, indices: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(source, dict):
        return np.asarray(source[key])[np.asarray(indices, np.int64)]
    return np.stack([np.asarray(r[key]) for r in read_records(source, indices)])


def _num(source) -> int:
    return len(source["label"] if isinstance(source, dict) and "label" in source
               else source["text"] if isinstance(source, dict) else source)


def _as_bytes(text) -> bytes:
    text = text.item() if isinstance(text, np.ndarray) else text
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)


def tfds_images(name: str, *, data_dir: str | None = None, download: bool = False,
                reader: str = "auto", in_memory: bool = True, normalize: str | None = "unit",
                flatten: bool = False, one_hot: bool = False) -> Dataset:
    """mnist / fashion_mnist / cifar10 / svhn_cropped: x float32 [B, H, W, C], y int32 [B].

    normalize: "unit" (x/255), "standard" (per-channel mean/std of the train split's first
    10,000 examples) or None (0..255); in_memory=False streams records through the host.
    """
    builder = _builder(name, data_dir, download)
    eval_split = IMAGE_DATASETS[name]
    sources = _sources(builder, ("train", eval_split), reader)
    num_classes = builder.info.features["label"].num_classes
    stored: dict[str, dict[str, np.ndarray]] = {}
    for split, source in sources.items():
        if in_memory or isinstance(source, dict):
            every = range(_num(source))
            stored[split] = {"x": _column(source, "image", every).astype(np.uint8),
                             "y": _column(source, "label", every).astype(np.int32)}
    if normalize not in ("unit", "standard", None):
        raise ValueError(f"normalize must be 'unit', 'standard' or None, got {normalize!r}")
    mean: tuple[float, ...] | float
    std: tuple[float, ...] | float
    scale, mean, std = (1.0, 0.0, 1.0) if normalize is None else (1 / 255, 0.0, 1.0)
    if normalize == "standard":
        first = (stored["train"]["x"][:_STATS_EXAMPLES] if "train" in stored else
                 _column(sources["train"], "image",
                         range(min(_STATS_EXAMPLES, _num(sources["train"])))))
        pixels = first.reshape(-1, first.shape[-1]).astype(np.float64) / 255
        mean, std = tuple(map(float, pixels.mean(0))), tuple(map(float, pixels.std(0)))
    view = ClassificationView(num_classes=num_classes, scale=scale, mean=mean, std=std,
                              flatten=flatten, one_hot=one_hot)

    def split_of(split: str) -> Split:
        if split in stored:
            return Split(len(stored[split]["y"]), view, stored[split])
        source = sources[split]

        def reader_fn(idx_B: np.ndarray):
            arrays = {"x": _column(source, "image", idx_B), "y": _column(source, "label", idx_B)}
            return view(arrays, np.arange(len(idx_B)))

        return Split(_num(source), view, reader=reader_fn)

    image_shape = tuple(builder.info.features["image"].shape)
    input_shape = (int(np.prod(image_shape)),) if flatten else image_shape
    return Dataset(name=name, task="classification", input_shape=input_shape,
                   splits={"train": split_of("train"), "eval": split_of(eval_split)},
                   num_classes=num_classes,
                   metadata={"data_dir": _resolve_data_dir(data_dir), "eval_split": eval_split,
                             "normalize": normalize, "mean": mean, "std": std})


def _split_text(source) -> str:
    if isinstance(source, dict):
        texts = source["text"]
    else:
        texts = [r["text"] for r in read_records(source, range(len(source)))]
    return b"".join(_as_bytes(t) for t in texts).decode("utf-8")


def tiny_shakespeare(*, data_dir: str | None = None, download: bool = False, reader: str = "auto",
                     seq_len: int = 128, stride: int | None = None) -> Dataset:
    """TFDS tiny_shakespeare as characters: x, y int32 [B, seq_len]; eval = validation."""
    builder = _builder("tiny_shakespeare", data_dir, download)
    sources = _sources(builder, ("train", "validation"), reader)
    return char_lm("tiny_shakespeare", _split_text(sources["train"]),
                   _split_text(sources["validation"]), seq_len=seq_len, stride=stride,
                   metadata={"data_dir": _resolve_data_dir(data_dir)})


def _byte_windows(source, seq_len: int) -> Split:
    """The split of lm1b's windows (module docstring) over `source`."""
    num = _num(source)

    def read(idx_B: np.ndarray) -> dict[str, np.ndarray]:
        idx_B = np.asarray(idx_B, np.int64)
        chunks: list[list[Any]] = [[] for _ in idx_B]
        lengths = np.zeros(len(idx_B), np.int64)
        todo, offset = np.arange(len(idx_B)), 0
        while todo.size:  # every sentence adds >= 1 byte, so this ends
            texts = (source["text"][(idx_B[todo] + offset) % num] if isinstance(source, dict)
                     else [r["text"] for r in read_records(source, (idx_B[todo] + offset) % num)])
            for j, text in zip(todo, texts, strict=True):
                piece = _as_bytes(text) + b"\n"
                chunks[j].append(piece)
                lengths[j] += len(piece)
            todo, offset = todo[lengths[todo] < seq_len + 1], offset + 1
        window = np.stack([np.frombuffer(b"".join(c)[: seq_len + 1], np.uint8) for c in chunks])
        window = window.astype(np.int32)
        return {"x": window[:, :-1], "y": window[:, 1:]}

    return Split(num, None, reader=read)


def lm1b(*, data_dir: str | None = None, download: bool = False, reader: str = "auto",
         seq_len: int = 128) -> Dataset:
    """LM1B as UTF-8 bytes, streamed: x, y int32 [B, seq_len], vocab_size 256."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    builder = _builder("lm1b", data_dir, download)
    sources = _sources(builder, ("train", "test"), reader)
    splits = {ours: _byte_windows(sources[theirs], seq_len)
              for ours, theirs in (("train", "train"), ("eval", "test"))}
    return Dataset(name="lm1b", task="lm", input_shape=(seq_len,), splits=splits,
                   vocab_size=256, vocab=None, seq_len=seq_len,
                   metadata={"data_dir": _resolve_data_dir(data_dir), "tokens": "utf-8 bytes"})
