"""cbs.data.tfds_source: fast failure when unprepared, mock_data, and real array_record files.

No network: the "real" datasets are tiny array_record copies written here by TFDS's own
writer under the registered names (mnist, tiny_shakespeare, lm1b), then read back through
`tfds.data_source` exactly as prepared downloads would be.
"""

import io
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cbs.data as data
from cbs.data.batching import device_batch, eval_batches, host_batch
from cbs.data.stream import stream_indices

tfds = pytest.importorskip("tensorflow_datasets")


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image[..., 0]).save(buffer, format="PNG")
    return buffer.getvalue()


def prepare_fake(name: str, features, splits: dict, data_dir) -> None:
    """Writes `splits` ({split: [example, ...]}, in that order) as array_record files under
    the registered `name`."""
    from tensorflow_datasets.core import registered

    version = tfds.builder_cls(name).VERSION
    with registered.skip_registration():
        class Fake(tfds.core.GeneratorBasedBuilder):
            VERSION = version

            def _info(self):
                return tfds.core.DatasetInfo(builder=self, features=features,
                                             disable_shuffling=True)  # keep our order

            def _split_generators(self, dl_manager):
                return {s: self._generate_examples(s) for s in splits}

            def _generate_examples(self, split):
                yield from enumerate(splits[split])

        Fake.name = name
        Fake(data_dir=str(data_dir), file_format="array_record").download_and_prepare()


@pytest.mark.parametrize("name", ["mnist", "cifar10", "tiny_shakespeare", "lm1b"])
def test_unprepared_dataset_fails_fast_and_says_how_to_prepare(tmp_path, name):
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as err:
        data.get_dataset(name, data_dir=str(tmp_path))
    assert time.perf_counter() - start < 10.0
    message = str(err.value)
    assert f"tfds build {name} --data_dir={tmp_path}" in message
    assert "--config.data.options.download=True" in message  # the flag that works
    assert "\n" not in message  # one line on the command line


def test_tfds_configs_take_the_download_option_on_the_command_line():
    from experiments.configs import cnn

    c = cnn.get_config("tiny")
    assert c.data.options.download is False and c.data.options.data_dir is None
    c.data.options.download, c.data.options.data_dir = True, "/data/tfds"
    assert set(c.data.options.to_dict()) <= set(data.dataset_options(c.data.name))


@pytest.mark.parametrize("name,shape", [("mnist", (28, 28, 1)), ("fashion_mnist", (28, 28, 1)),
                                        ("cifar10", (32, 32, 3)), ("svhn_cropped", (32, 32, 3))])
def test_images_on_mock_data(name, shape):
    with tfds.testing.mock_data(num_examples=24):
        ds = data.get_dataset(name, download=True)
    assert (ds.num_train, ds.num_eval, ds.input_shape, ds.num_classes) == (24, 24, shape, 10)
    assert ds.train["x"].dtype == np.uint8
    batch = host_batch(ds, 20, 8, seed=0)
    assert batch["x"].shape == (8,) + shape and batch["x"].dtype == np.float32
    assert 0.0 <= batch["x"].min() and batch["x"].max() <= 1.0
    assert batch["y"].dtype == np.int32 and batch["y"].max() < 10


def test_text_on_mock_data():
    with tfds.testing.mock_data(num_examples=20):
        chars = data.get_dataset("tiny_shakespeare", download=True, seq_len=8)
        lm1b = data.get_dataset("lm1b", download=True, seq_len=16)
        batch = host_batch(lm1b, 0, 4, seed=0)
    assert chars.task == "lm" and chars.vocab_size == len(chars.vocab)
    assert host_batch(chars, 0, 4, seed=0)["x"].shape == (4, 8)
    assert (lm1b.num_train, lm1b.vocab_size) == (20, 256)
    assert batch["x"].shape == (4, 16) and batch["x"].dtype == np.int32
    assert 0 <= batch["x"].min() and batch["x"].max() < 256


@pytest.fixture(scope="module")
def fake_mnist(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    rng = np.random.default_rng(0)
    images = {"train": rng.integers(0, 256, (40, 28, 28, 1), dtype=np.uint8),
              "test": rng.integers(0, 256, (12, 28, 28, 1), dtype=np.uint8)}
    splits = {s: [{"image": _png(im), "label": i % 10} for i, im in enumerate(images[s])]
              for s in images}
    features = tfds.features.FeaturesDict({
        "image": tfds.features.Image(shape=(28, 28, 1)),
        "label": tfds.features.ClassLabel(num_classes=10)})
    prepare_fake("mnist", features, splits, data_dir)
    return str(data_dir), images


def test_local_array_record_images_in_memory_and_streamed(fake_mnist):
    data_dir, images = fake_mnist
    ds = data.get_dataset("mnist", data_dir=data_dir)
    assert (ds.num_train, ds.num_eval, ds.input_shape) == (40, 12, (28, 28, 1))
    np.testing.assert_array_equal(ds.train["x"], images["train"])
    np.testing.assert_array_equal(ds.eval["y"], np.arange(12) % 10)
    streamed = data.get_dataset("mnist", data_dir=data_dir, in_memory=False, flatten=True)
    assert not streamed.in_memory() and streamed.input_shape == (784,)
    for s in (0, 30):
        want = host_batch(ds, s, 16, seed=1)
        got = host_batch(streamed, s, 16, seed=1)
        np.testing.assert_array_equal(got["x"], want["x"].reshape(16, -1))
        np.testing.assert_array_equal(got["y"], want["y"])
        np.testing.assert_allclose(
            want["x"], images["train"][stream_indices(s, 16, 40, 1)] / 255, rtol=1e-6)
    on_device = jax.jit(lambda a: device_batch(ds, a, jnp.int32(30), 16, seed=1))(
        ds.device_arrays())
    np.testing.assert_array_equal(np.asarray(on_device["x"]), want["x"])


def test_local_array_record_standardised(fake_mnist):
    data_dir, images = fake_mnist
    ds = data.get_dataset("mnist", data_dir=data_dir, normalize="standard", one_hot=True)
    x = np.concatenate([b["x"] for b in eval_batches(ds, 16, split="train")])
    assert abs(x.mean()) < 1e-5 and abs(x.std() - 1.0) < 1e-5
    assert host_batch(ds, 0, 4, seed=0)["y"].shape == (4, 10)
    with pytest.raises(ValueError, match="normalize"):
        data.get_dataset("mnist", data_dir=data_dir, normalize="zca")
    with pytest.raises(ValueError, match="reader must be"):
        data.get_dataset("mnist", data_dir=data_dir, reader="grain")
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs TensorFlow"):
            data.get_dataset("mnist", data_dir=data_dir, reader="load")


def test_local_array_record_tiny_shakespeare(tmp_path):
    texts = {"train": "First Citizen:\nBefore we proceed any further, hear me speak.\n",
             "validation": "All:\nSpeak, speak.\n", "test": "First Citizen:\nYou are all.\n"}
    prepare_fake("tiny_shakespeare", tfds.features.FeaturesDict({"text": tfds.features.Text()}),
                 {s: [{"text": t}] for s, t in texts.items()}, tmp_path)
    ds = data.get_dataset("tiny_shakespeare", data_dir=str(tmp_path), seq_len=10, stride=1)
    assert ds.num_train == len(texts["train"]) - 10
    assert ds.num_eval == (len(texts["validation"]) - 11) // 10 + 1
    batch = host_batch(ds, 0, 5, seed=0)
    starts = stream_indices(0, 5, ds.num_train, 0)
    for row, start in zip(batch["x"], starts, strict=True):
        assert ds.decode(row) == texts["train"][start:start + 10]
    with pytest.raises(ValueError, match="too long"):
        data.get_dataset("tiny_shakespeare", data_dir=str(tmp_path), seq_len=100)


def test_local_array_record_lm1b_byte_windows(tmp_path):
    sentences = {"train": ["The cat sat .", "A dog ran !", "Ça va ?", "Short ."],
                 "test": ["One .", "Two ."]}
    prepare_fake("lm1b", tfds.features.FeaturesDict({"text": tfds.features.Text()}),
                 {s: [{"text": t} for t in ts] for s, ts in sentences.items()}, tmp_path)
    ds = data.get_dataset("lm1b", data_dir=str(tmp_path), seq_len=20)
    assert (ds.num_train, ds.num_eval, ds.vocab_size) == (4, 2, 256)
    assert not ds.in_memory()
    stream = "".join(s + "\n" for s in sentences["train"]).encode() * 2
    offsets = np.cumsum([0] + [len((s + "\n").encode()) for s in sentences["train"]])
    batch = host_batch(ds, 0, 4, seed=3)
    for row_x, row_y, i in zip(batch["x"], batch["y"], stream_indices(0, 4, 4, 3),
                               strict=True):
        window = np.frombuffer(stream[offsets[i]:offsets[i] + 21], np.uint8)
        np.testing.assert_array_equal(row_x, window[:-1])
        np.testing.assert_array_equal(row_y, window[1:])
    assert ds.decode(batch["x"][0]).startswith(sentences["train"][int(
        stream_indices(0, 1, 4, 3)[0])])
    evals = list(eval_batches(ds, 2))
    assert ds.decode(evals[0]["x"][0]).startswith("One .\nTwo .\nOne .")
