"""The example stream: which example sits at each position, as a pure function of the seed.

Letters: N examples in the split, B batch size, s examples seen (a stream position),
e epoch, R Feistel rounds.

The training stream of a split is the infinite concatenation of epoch permutations
π_0, π_1, ... of {0, ..., N-1}; π_e is keyed by `fold_in(key(seed), e)`. Stream position p
holds example π_{p // N}(p mod N), and the global batch at examples-seen s with size B is
positions [s, s + B). So a resumed run sees the same batches, and a run whose batch size
changes mid-way keeps reading the stream in order: no example is skipped or repeated within
an epoch, whatever the batch sizes.

π_e is a keyed pseudo-random permutation evaluated index by index (a balanced Feistel
network on the smallest 4^h ≥ N with cycle walking, Black & Rogaway 2002), not a sorted
random vector: one position costs O(R) integer ops, so a batch costs O(B) for any N, with
no per-epoch table. The numpy and jax versions are the same uint32 arithmetic and return
identical indices, so the host path and the on-device gather deliver identical batches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

NUM_ROUNDS = 8
# lowbias32 multipliers (C. Wellons, "Prospecting for hash functions", 2018).
_M1 = 0x7FEB352D
_M2 = 0x846CA68B


def check_batch_size(batch_size: int, num_examples: int, what: str = "the split") -> None:
    """Raises ValueError unless 1 <= batch_size <= num_examples (no example twice per batch)."""
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if batch_size > num_examples:
        raise ValueError(
            f"batch_size={batch_size} is larger than {what} ({num_examples} examples): one "
            "batch would repeat examples; use a smaller batch or a larger dataset")


@jax.jit
def _epoch_keys_jax(seed: jax.Array, epoch: jax.Array) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed), epoch)
    return jax.random.bits(key, (NUM_ROUNDS,), jnp.uint32)


@functools.lru_cache(maxsize=64)
def epoch_keys(seed: int, epoch: int) -> np.ndarray:
    """Round keys uint32 [R] of epoch permutation π_epoch (from fold_in(key(seed), epoch))."""
    return np.asarray(_epoch_keys_jax(np.uint32(seed % 2**32), np.uint32(epoch % 2**32)))


def _half_bits(num_examples: int) -> int:
    """Smallest h with 4^h >= N (h >= 1): the Feistel domain is [0, 4^h)."""
    h = 1
    while 4**h < num_examples:
        h += 1
    if 2 * h > 32:
        raise ValueError(f"at most 2^32 examples per split are supported, got {num_examples}")
    return h


def _hash(xp, v):
    v = v ^ (v >> 16)
    v = v * xp.uint32(_M1)
    v = v ^ (v >> 15)
    v = v * xp.uint32(_M2)
    return v ^ (v >> 16)


def _feistel(xp, x_B, keys_BxR, h: int):
    """One pass of the balanced Feistel network on 2h-bit values (a bijection of [0, 4^h))."""
    mask = xp.uint32((1 << h) - 1)
    left, right = x_B >> h, x_B & mask
    for r in range(NUM_ROUNDS):
        left, right = right, left ^ (_hash(xp, right ^ keys_BxR[:, r]) & mask)
    return (left << h) | right


def permute_np(i_B: np.ndarray, keys_BxR: np.ndarray, num_examples: int) -> np.ndarray:
    """π(i) for indices i in [0, N) with per-index round keys (numpy, host)."""
    h = _half_bits(num_examples)
    x = i_B.astype(np.uint32)
    todo = np.ones(x.shape, bool)
    while todo.any():  # cycle walking: re-apply until the value lands in [0, N)
        x[todo] = _feistel(np, x[todo], keys_BxR[todo], h)
        todo = x >= num_examples
    return x.astype(np.int64)


def permute_jax(i_B: jax.Array, keys_BxR: jax.Array, num_examples: int) -> jax.Array:
    """π(i) for indices i in [0, N) with per-index round keys (jittable)."""
    h = _half_bits(num_examples)

    def body(x):
        return jnp.where(x >= num_examples, _feistel(jnp, x, keys_BxR, h), x)

    def cond(x):
        return jnp.any(x >= num_examples)

    x = _feistel(jnp, i_B.astype(jnp.uint32), keys_BxR, h)
    return jax.lax.while_loop(cond, body, x).astype(jnp.int32)


def stream_indices_np(examples_seen: int, batch_size: int, num_examples: int, seed: int,
                      *, shuffle: bool = True) -> np.ndarray:
    """Example indices int64 [B] at stream positions [s, s + B) (host; exact Python ints)."""
    positions = int(examples_seen) + np.arange(batch_size, dtype=np.int64)
    return positions_to_indices_np(positions, num_examples, seed, shuffle=shuffle)


def positions_to_indices_np(positions: np.ndarray, num_examples: int, seed: int,
                            *, shuffle: bool = True) -> np.ndarray:
    """Example indices int64 for arbitrary stream positions (host)."""
    positions = np.asarray(positions, np.int64)
    if positions.size and positions.min() < 0:
        raise ValueError("stream positions must be >= 0")
    epoch, offset = np.divmod(positions, num_examples)
    if not shuffle:
        return offset
    keys = np.empty(positions.shape + (NUM_ROUNDS,), np.uint32)
    for e in np.unique(epoch):
        keys[epoch == e] = epoch_keys(int(seed), int(e))
    return permute_np(offset, keys, num_examples)


def stream_indices_jax(examples_seen: jax.Array | int, batch_size: int, num_examples: int,
                       seed: jax.Array | int, *, shuffle: bool = True) -> jax.Array:
    """Example indices int32 [B] at stream positions [s, s + B) (jittable; s may be traced).

    `batch_size` and `num_examples` are static. `examples_seen` is an int32 scalar (int64
    when x64 is on), so on device s + B must stay below 2^31 without x64.
    """
    s = jnp.asarray(examples_seen)
    positions = s + jnp.arange(batch_size, dtype=s.dtype)
    epoch, offset = positions // num_examples, positions % num_examples
    if not shuffle:
        return offset.astype(jnp.int32)
    # A batch spans at most K consecutive epochs, starting at s // N.
    num_epochs = (batch_size - 1) // num_examples + 2
    first = s // num_examples
    epochs_K = (first + jnp.arange(num_epochs, dtype=s.dtype)).astype(jnp.uint32)
    seed_u32 = jnp.asarray(seed).astype(jnp.uint32)
    keys_KxR = jax.vmap(_epoch_keys_jax, in_axes=(None, 0))(seed_u32, epochs_K)
    keys_BxR = keys_KxR[epoch - first]
    return permute_jax(offset, keys_BxR, num_examples)


def stream_indices(examples_seen, batch_size: int, num_examples: int, seed,
                   *, shuffle: bool = True):
    """Example indices at stream positions [s, s + B): numpy for Python/numpy ints,
    jax (jittable) when `examples_seen` or `seed` is a jax array."""
    if isinstance(examples_seen, jax.Array) or isinstance(seed, jax.Array):
        return stream_indices_jax(examples_seen, batch_size, num_examples, seed,
                                  shuffle=shuffle)
    return stream_indices_np(examples_seen, batch_size, num_examples, seed, shuffle=shuffle)
