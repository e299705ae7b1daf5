"""cbs.data.stream: epoch permutations are bijections, seeded, identical on host and device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbs.data import stream


@pytest.mark.parametrize("num", [1, 2, 3, 5, 16, 17, 1000, 4097])
def test_every_epoch_is_a_permutation(num):
    for epoch in range(3):
        idx = stream.stream_indices_np(epoch * num, num, num, seed=11)
        np.testing.assert_array_equal(np.sort(idx), np.arange(num))


@pytest.mark.parametrize("num,batch,starts", [
    (10, 7, (0, 8, 15)), (4097, 300, (0, 4000)),
    (5, 12, (3,)),  # a batch larger than the split spans three epochs
])
def test_numpy_and_jax_agree(num, batch, starts):
    fn = jax.jit(lambda s, seed: stream.stream_indices(s, batch, num, seed))
    for start in starts:
        host = stream.stream_indices(start, batch, num, seed=3)
        assert isinstance(host, np.ndarray)
        device = fn(jnp.int32(start), jnp.int32(3))
        np.testing.assert_array_equal(np.asarray(device), host)


def test_positions_are_the_concatenated_epochs():
    num = 13
    per_epoch = [stream.stream_indices_np(e * num, num, num, seed=5) for e in range(4)]
    everything = stream.stream_indices_np(0, 4 * num, num, seed=5)
    np.testing.assert_array_equal(everything, np.concatenate(per_epoch))
    assert not np.array_equal(per_epoch[0], per_epoch[1])


def test_seeds_and_epochs_differ_and_no_shuffle_is_identity():
    a = stream.stream_indices_np(0, 100, 100, seed=0)
    b = stream.stream_indices_np(0, 100, 100, seed=1)
    assert np.mean(a == b) < 0.1
    np.testing.assert_array_equal(stream.stream_indices_np(205, 10, 100, 0, shuffle=False),
                                  np.arange(5, 15))


def test_permutations_look_uniform():
    # First element of 2,000 epochs of a 10-element split: chi-square with 9 dof, < 27.9
    # (the 0.1% point), and P(π(0) < π(1)) ≈ 1/2.
    num, epochs = 10, 2000
    firsts, pairs = np.zeros(num), 0
    for e in range(epochs):
        idx = stream.stream_indices_np(e * num, 2, num, seed=0)
        firsts[idx[0]] += 1
        pairs += idx[0] < idx[1]
    expected = epochs / num
    assert np.sum((firsts - expected) ** 2 / expected) < 27.9
    assert abs(pairs / epochs - 0.5) < 4 * 0.5 / np.sqrt(epochs)
    # Position and index are uncorrelated within an epoch of 5,000.
    idx = stream.stream_indices_np(0, 5000, 5000, seed=0)
    assert abs(np.corrcoef(np.arange(5000), idx)[0, 1]) < 4 / np.sqrt(5000)


def test_cycle_structure_matches_a_uniform_permutation():
    # A uniform random permutation has on average 1 fixed point and 1/2 two-cycle (both
    # counts ~ Poisson); too few shuffle rounds leave about twice as many.
    num, epochs = 1024, 400
    fixed, two_cycles = [], []
    for e in range(epochs):
        p = stream.stream_indices_np(e * num, num, num, seed=0)
        fixed.append(np.sum(p == np.arange(num)))
        two_cycles.append(np.sum((p[p] == np.arange(num)) & (p != np.arange(num))) / 2)
    assert abs(np.mean(fixed) - 1.0) < 4 * np.sqrt(1.0 / epochs)
    assert abs(np.mean(two_cycles) - 0.5) < 4 * np.sqrt(0.5 / epochs)


def test_epoch_tables_equal_per_index_evaluation(monkeypatch):
    cached = stream.stream_indices_np(1500, 1000, 1000, seed=4)
    monkeypatch.setattr(stream, "_TABLE_MAX", 0)
    np.testing.assert_array_equal(stream.stream_indices_np(1500, 1000, 1000, seed=4), cached)


def test_large_positions_with_x64(x64):
    start, batch, num = 3 * 2**31 + 5, 50, 1_000_003
    host = stream.stream_indices_np(start, batch, num, seed=9)
    device = jax.jit(lambda s: stream.stream_indices_jax(s, batch, num, 9))(jnp.int64(start))
    np.testing.assert_array_equal(np.asarray(device), host)


def test_bad_sizes():
    with pytest.raises(ValueError, match="larger than"):
        stream.check_batch_size(11, 10)
    with pytest.raises(ValueError, match="positive integer"):
        stream.check_batch_size(0, 10)
    with pytest.raises(ValueError, match=">= 0"):
        stream.positions_to_indices_np(np.array([-1]), 10, 0)
