"""cbs.data registry and cbs.data.dataset: views give the same batches on host and device."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import cbs.data as data
from cbs.data.dataset import ClassificationView, Dataset, Split, WindowView, num_windows


def test_registry_errors_list_the_known_names_and_options():
    with pytest.raises(ValueError, match="known datasets: .*digits.*mnist1d"):
        data.get_dataset("imagenet")
    with pytest.raises(ValueError, match="known: split_seed"):
        data.get_dataset("digits", batch=3)
    assert "seq_len" in data.dataset_options("shakespeare_char")
    assert set(data.known_datasets()) >= {
        "digits", "mnist1d", "shakespeare_char", "linreg", "teacher_student", "mnist",
        "fashion_mnist", "cifar10", "svhn_cropped", "tiny_shakespeare", "lm1b"}
    with pytest.raises(ValueError, match="already registered"):
        data.register("digits", lambda: None)


@pytest.mark.parametrize("name", ["mnist", "tiny_shakespeare"])
def test_a_tfds_dataset_without_tensorflow_datasets_names_the_extra(monkeypatch, tmp_path,
                                                                     name):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # as if not installed
    with pytest.raises(ImportError, match=r'pip install -e "\.\[tfds\]"'):
        data.get_dataset(name, data_dir=str(tmp_path))


def test_classification_view_numpy_equals_jax():
    rng = np.random.default_rng(0)
    arrays = {"x": rng.integers(0, 256, (6, 2, 2, 3), dtype=np.uint8),
              "y": np.array([0, 1, 2, 0, 1, 2])}
    view = ClassificationView(num_classes=3, scale=1 / 255, mean=(0.1, 0.2, 0.3),
                              std=(0.5, 0.5, 2.0), flatten=True, one_hot=True)
    idx = np.array([5, 0, 3])
    host = view(arrays, idx)
    device = jax.jit(view)({k: jnp.asarray(v) for k, v in arrays.items()}, jnp.asarray(idx))
    want = ((arrays["x"][idx] / 255 - np.array([0.1, 0.2, 0.3])) / np.array([0.5, 0.5, 2.0]))
    np.testing.assert_allclose(host["x"], want.reshape(3, -1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(device["x"]), host["x"], rtol=1e-6)
    np.testing.assert_array_equal(host["y"], np.eye(3, dtype=np.float32)[[2, 0, 0]])
    np.testing.assert_array_equal(np.asarray(device["y"]), host["y"])


def test_window_view_shifts_targets():
    tokens = np.arange(20, dtype=np.uint8)
    batch = WindowView(seq_len=4, stride=3)({"tokens": tokens}, np.array([0, 2]))
    np.testing.assert_array_equal(batch["x"], [[0, 1, 2, 3], [6, 7, 8, 9]])
    np.testing.assert_array_equal(batch["y"], [[1, 2, 3, 4], [7, 8, 9, 10]])
    assert batch["x"].dtype == np.int32
    assert num_windows(20, 4, 3, "t") == 6  # starts 0, 3, ..., 15 (15 + 5 = 20)
    with pytest.raises(ValueError, match="seq_len=20 is too long for t"):
        num_windows(20, 20, 1, "t")


def test_streamed_split_and_device_arrays():
    streamed = Split(3, None, reader=lambda idx: {"x": idx.astype(np.float32),
                                                  "y": idx.astype(np.float32)})
    ds = Dataset(name="s", task="regression", input_shape=(), splits={"train": streamed,
                                                                       "eval": streamed})
    assert ds.train is None and not ds.in_memory()
    np.testing.assert_array_equal(streamed.read(np.array([2, 0]))["x"], [2.0, 0.0])
    with pytest.raises(ValueError, match="streamed"):
        ds.device_arrays()
    with pytest.raises(ValueError, match="has splits"):
        ds.split("test")
    with pytest.raises(ValueError, match="task must be"):
        Dataset(name="s", task="ranking", input_shape=(), splits={})
    digits = data.get_dataset("digits")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    arrays = digits.device_arrays("eval", sharding=NamedSharding(mesh, P()))
    assert arrays["x"].sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(arrays["x"]), digits.eval["x"])


def test_byte_vocabulary_round_trip():
    ds = Dataset(name="b", task="lm", input_shape=(4,), splits={}, vocab_size=256)
    ids = ds.encode("Ça va")
    assert ids.dtype == np.int32 and len(ids) == 6
    assert ds.decode(ids) == "Ça va"
