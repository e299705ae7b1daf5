"""cbs.data.embedded: digits, mnist1d and shakespeare_char load offline with documented shapes."""

import hashlib
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cbs.data as data
from cbs.data import embedded
from cbs.data.batching import device_batch, host_batch
from cbs.data.stream import stream_indices


def test_digits_shapes_range_and_fixed_split():
    ds = data.get_dataset("digits")
    assert (ds.task, ds.num_classes, ds.input_shape) == ("classification", 10, (64,))
    assert (ds.num_train, ds.num_eval) == (1438, 359)
    assert ds.train["x"].dtype == np.float32 and ds.train["y"].dtype == np.int32
    assert ds.train["x"].min() == 0.0 and ds.train["x"].max() == 1.0
    assert set(np.unique(ds.train["y"])) == set(range(10))
    again = data.get_dataset("digits")
    np.testing.assert_array_equal(again.eval["x"], ds.eval["x"])
    other = data.get_dataset("digits", split_seed=1)
    assert not np.array_equal(other.eval["x"], ds.eval["x"])
    images = data.get_dataset("digits", flatten=False, one_hot=True)
    batch = host_batch(images, 0, 4, seed=0)
    assert batch["x"].shape == (4, 8, 8, 1) and batch["y"].shape == (4, 10)
    np.testing.assert_array_equal(batch["y"].sum(1), np.ones(4, np.float32))


def test_digits_are_scikit_learns_read_without_importing_it(monkeypatch):
    """The file read directly equals `load_digits` bit for bit, and the fallback (no file at
    the usual place) is `load_digits` itself."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pixels, labels = embedded._digits_arrays()
    np.testing.assert_array_equal(pixels, bunch.data)
    np.testing.assert_array_equal(labels, bunch.target)
    embedded._digits_arrays.cache_clear()
    monkeypatch.setattr(embedded.os.path, "exists", lambda path: False)
    try:
        fallback = embedded._digits_arrays()
    finally:
        embedded._digits_arrays.cache_clear()
    np.testing.assert_array_equal(fallback[0], bunch.data)


def test_mnist1d_shapes_and_global_rngs_untouched():
    np_state, py_state = np.random.get_state()[1].copy(), random.getstate()  # noqa: NPY002
    ds = data.get_dataset("mnist1d")
    np.testing.assert_array_equal(np.random.get_state()[1], np_state)  # noqa: NPY002
    assert random.getstate() == py_state
    assert (ds.num_train, ds.num_eval, ds.input_shape, ds.num_classes) == (4000, 1000, (40,), 10)
    assert ds.train["x"].dtype == np.float32 and ds.train["y"].dtype == np.int32
    assert abs(float(ds.train["x"].std()) - 1.0) < 0.05
    small = data.get_dataset("mnist1d", num_samples=200)
    assert (small.num_train, small.num_eval) == (160, 40)
    with pytest.raises(ValueError, match="unknown mnist1d options"):
        data.get_dataset("mnist1d", bogus=1)


def test_shakespeare_char_windows_vocab_and_text():
    ds = data.get_dataset("shakespeare_char", seq_len=64)
    assert (ds.task, ds.input_shape, ds.seq_len) == ("lm", (64,), 64)
    assert ds.vocab_size == len(ds.vocab) < 128
    assert not set("*#_\\") & set(ds.vocab)  # markup is gone
    text = embedded.shakespeare_text()
    assert "To be, or not to be" in text and "HAMLET:" in text
    assert ds.metadata["num_train_tokens"] + ds.metadata["num_eval_tokens"] == len(text)
    assert ds.num_train == (ds.metadata["num_train_tokens"] - 65) // 64 + 1
    batch = host_batch(ds, 0, 8, seed=0)
    assert batch["x"].shape == (8, 64) and batch["x"].dtype == np.int32
    np.testing.assert_array_equal(batch["x"][:, 1:], batch["y"][:, :-1])
    # Example i is the text window starting at i * stride.
    i = int(stream_indices(0, 1, ds.num_train, 0)[0])
    assert ds.decode(batch["x"][0]) == text[i * 64:(i + 1) * 64]
    assert ds.decode(ds.encode("Fair is foul")) == "Fair is foul"
    on_device = jax.jit(lambda a, s: device_batch(ds, a, s, 8, seed=0))(
        ds.device_arrays(), jnp.int32(0))
    np.testing.assert_array_equal(np.asarray(on_device["y"]), batch["y"])


def test_shakespeare_char_options_and_errors():
    macbeth = data.get_dataset("shakespeare_char", plays=["macbeth"], seq_len=32, stride=1)
    assert macbeth.num_train == macbeth.metadata["num_train_tokens"] - 32
    with pytest.raises(ValueError, match="too long"):
        data.get_dataset("shakespeare_char", plays=["macbeth"], seq_len=200_000)
    with pytest.raises(ValueError, match="unknown plays"):
        data.get_dataset("shakespeare_char", plays=["hamlet-the-musical"])


def test_shipped_plays_are_the_38_plays_in_a_fixed_text():
    plays = embedded.shakespeare_plays()
    assert len(plays) == 38 and list(plays) == sorted(plays)
    assert {k.split("/")[0] for k in plays} == {
        "comedies", "histories", "problems", "roman", "romances", "tragedies"}
    # The corpus every recorded study used: its length and digest may never change.
    text = embedded.shakespeare_text()
    assert len(text) == 4_986_943
    assert hashlib.md5(text.encode()).hexdigest() == "161581636429d42ce9422743b50591d6"


def test_missing_mnist1d_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mnist1d.data", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r'pip install -e "\.\[mnist1d\]"'):
        embedded.mnist1d()
