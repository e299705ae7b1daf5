"""cbs.data.batching: determinism, resume, ramps, host/device agreement, multi-host slices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import cbs.data as data
from cbs.data.batching import (
    device_batch,
    eval_batches,
    evaluate,
    global_batch,
    host_batch,
    process_rows,
)
from cbs.data.dataset import Dataset, RegressionView, Split
from cbs.data.stream import stream_indices

NUM = 100  # examples in the index dataset


def index_dataset(num: int = NUM) -> Dataset:
    """Example i has x = [i, -i] and y = i, so a batch shows which examples it holds."""
    ids = np.arange(num, dtype=np.float32)
    arrays = {"x": np.stack([ids, -ids], 1), "y": ids}
    split = Split(num, RegressionView(), arrays)
    return Dataset(name="index", task="regression", input_shape=(2,),
                   splits={"train": split, "eval": split})


def ids(batch) -> np.ndarray:
    return np.asarray(batch["y"]).astype(np.int64)


def run(ds, sizes, *, seed=0, start=0):
    """Batches of the given sizes read one after another from examples_seen = start."""
    out, seen = [], start
    for b in sizes:
        out.append(ids(host_batch(ds, seen, b, seed=seed)))
        seen += b
    return out


def test_same_seed_same_batches_other_seed_other_batches():
    ds = index_dataset()
    a, b, c = run(ds, [16] * 10), run(ds, [16] * 10), run(ds, [16] * 10, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_resume_at_step_k_gives_the_uninterrupted_batches():
    ds = index_dataset()
    whole = run(ds, [24] * 12)
    k = 5  # "restart" with examples_seen restored from a checkpoint
    resumed = run(ds, [24] * 7, start=24 * k)
    for x, y in zip(whole[k:], resumed, strict=True):
        np.testing.assert_array_equal(x, y)


def test_ramp_consumes_the_planned_stream():
    # Batch 32 for k steps, then 64: the examples read are stream positions [0, E) in order,
    # and every epoch holds each example exactly once.
    ds, k = index_dataset(), 4
    sizes = [32] * k + [64] * 6
    seen = np.concatenate(run(ds, sizes))
    total = sum(sizes)
    np.testing.assert_array_equal(seen, stream_indices(0, total, NUM, 0))
    for e in range(total // NUM):
        np.testing.assert_array_equal(np.sort(seen[e * NUM:(e + 1) * NUM]), np.arange(NUM))
    # The same data on device, with a jitted gather per batch size.
    arrays = ds.device_arrays()
    step = jax.jit(functools.partial(device_batch, ds, seed=0), static_argnums=2)
    on_device, s = [], 0
    for b in sizes:
        on_device.append(ids(step(arrays, jnp.int32(s), b)))
        s += b
    np.testing.assert_array_equal(np.concatenate(on_device), seen)


def test_two_processes_read_disjoint_slices_whose_union_is_the_global_batch():
    ds, batch = index_dataset(), 48
    for s in (0, 90):  # the second batch straddles an epoch boundary
        whole = ids(host_batch(ds, s, batch, seed=2))
        parts = [ids(host_batch(ds, s, batch, seed=2, rows=slice(p * 24, (p + 1) * 24)))
                 for p in range(2)]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
        if s == 0:  # within one epoch the two processes share no example
            assert not set(parts[0]) & set(parts[1])


def test_global_batch_on_a_mesh_equals_the_host_batch():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))
    ds = index_dataset()
    np.testing.assert_array_equal(process_rows(sharding, (32, 2)), np.arange(32))
    got = global_batch(ds, sharding, 70, 32, seed=4)
    want = host_batch(ds, 70, 32, seed=4)
    for k in want:
        assert got[k].sharding == sharding and got[k].shape == want[k].shape
        np.testing.assert_array_equal(np.asarray(got[k]), want[k])
    with pytest.raises(ValueError, match="not divisible"):
        global_batch(ds, sharding, 0, 12, seed=4)


def test_device_batch_is_shardable_inside_jit():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    ds = index_dataset()
    arrays = ds.device_arrays(sharding=NamedSharding(mesh, P()))
    batch_fn = data.make_batch_fn(ds, seed=7)

    @functools.partial(jax.jit, static_argnums=2)
    def step(arrays, examples_seen, batch_size):
        batch = batch_fn(arrays, examples_seen, batch_size)
        batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P("data")))
        return batch, jnp.mean(batch["x"][:, 0])

    batch, _ = step(arrays, jnp.int32(40), 16)
    np.testing.assert_array_equal(ids(batch), ids(host_batch(ds, 40, 16, seed=7)))
    assert batch["x"].sharding.spec == P("data")


def test_host_loader_prefetch_returns_the_pure_batches():
    ds = index_dataset()
    schedule = lambda s: 16 if s < 64 else 32  # noqa: E731
    with data.HostLoader(ds, seed=3, prefetch=3, batch_size_fn=schedule) as loader:
        seen = 0
        for _ in range(8):
            b = schedule(seen)
            np.testing.assert_array_equal(ids(loader(seen, b)),
                                          ids(host_batch(ds, seen, b, seed=3)))
            seen += b
        # A request off the predicted path (an adaptive schedule) is still exact.
        np.testing.assert_array_equal(ids(loader(5, 8)), ids(host_batch(ds, 5, 8, seed=3)))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with data.HostLoader(ds, seed=3, sharding=NamedSharding(mesh, P("data"))) as loader:
        got = loader(10, 16)
        assert isinstance(got["x"], jax.Array) and got["x"].sharding.spec == P("data")
        np.testing.assert_array_equal(ids(got), ids(host_batch(ds, 10, 16, seed=3)))


def test_eval_batches_and_evaluate_are_fixed_and_exact():
    ds = index_dataset(37)
    batches = list(eval_batches(ds, 10))
    assert [len(ids(b)) for b in batches] == [10, 10, 10, 7]
    np.testing.assert_array_equal(np.concatenate([ids(b) for b in batches]), np.arange(37))
    metric = jax.jit(lambda batch: {"mean": jnp.mean(batch["y"]),
                                    "sq": jnp.mean(batch["y"] ** 2)})
    want = {"mean": np.arange(37).mean(), "sq": (np.arange(37) ** 2).mean()}
    host = evaluate(metric, ds, batch_size=10)
    device = evaluate(metric, ds, batch_size=10, split="train", arrays=ds.device_arrays())
    limited = evaluate(metric, ds, batch_size=10, limit=5)
    for got in (host, device):
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-6)
    assert limited["mean"] == pytest.approx(2.0)


def test_batch_size_errors():
    ds = index_dataset(10)
    with pytest.raises(ValueError, match="larger than index/train"):
        host_batch(ds, 0, 11, seed=0)
    with pytest.raises(ValueError, match="larger than"):
        device_batch(ds, ds.device_arrays(), 0, 11, seed=0)


_WORKER = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=60)
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import cbs.data as data
from cbs.data.batching import global_batch
mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
ds = data.get_dataset("linreg", dim=3, num_train=100, num_eval=10)
batch = global_batch(ds, NamedSharding(mesh, P("data")), 90, 32, seed=5)
rows, xs = [], []
for shard in batch["x"].addressable_shards:
    rows.append(np.arange(32)[shard.index[0]])
    xs.append(np.asarray(shard.data))
np.savez(out, rows=np.concatenate(rows), x=np.concatenate(xs))
"""


def test_two_real_processes_build_one_global_batch(tmp_path):
    # Two local processes (4 CPU devices each) on loopback form one 8-device mesh; each
    # reads only its rows, and together they hold exactly the single-process batch.
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    procs = [subprocess.Popen([sys.executable, str(script), str(p), str(port),
                               str(tmp_path / f"p{p}.npz")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for p in range(2)]
    for proc in procs:
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out.decode()[-3000:]
    parts = [np.load(tmp_path / f"p{p}.npz") for p in range(2)]
    np.testing.assert_array_equal(parts[0]["rows"], np.arange(16))
    np.testing.assert_array_equal(parts[1]["rows"], np.arange(16, 32))
    ds = data.get_dataset("linreg", dim=3, num_train=100, num_eval=10)
    want = host_batch(ds, 90, 32, seed=5)["x"]
    np.testing.assert_array_equal(np.concatenate([p["x"] for p in parts]), want)
