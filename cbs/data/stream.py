"""The example stream: which example sits at each position, as a pure function of the seed.

Letters: N examples in the split, B batch size, s examples seen (a stream position),
e epoch, R shuffle rounds.

The training stream of a split is the infinite concatenation of epoch permutations
π_0, π_1, ... of {0, ..., N-1}, π_e keyed by `fold_in(key(seed), e)`: position p holds
example π_{p // N}(p mod N), and the global batch at s with size B is positions [s, s + B).
A resumed run sees the same batches, and a run whose batch size changes keeps reading the
stream in order: no example is skipped or repeated within an epoch.

π_e is the swap-or-not shuffle (Hoang, Morris & Rogaway, CRYPTO 2012), evaluated index by index:
round r pairs x with K_r − x (mod N) and swaps the pair when a keyed hash of max(x, K_r − x) is odd;
each round is an involution, so the composition is a permutation for any N. R = 2⌈log2 N⌉ + 16
rounds (fixed points and 2-cycles then match a uniform permutation's in Monte Carlo checks); a batch
costs O(B·R) for any N. Keys use threefry whatever jax's default PRNG. The numpy and jax versions
are the same uint32 arithmetic, so the host path and the on-device gather deliver identical batches.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "check_batch_size", "positions_to_indices_np", "stream_indices", "stream_indices_jax",
    "stream_indices_np",
]

_TABLE_MAX = 2**22  # host: cache whole epoch permutations up to this N


def _num_rounds(num_examples: int) -> int:
    """Swap-or-not rounds R used for a split of N examples."""
    return 2 * math.ceil(math.log2(max(num_examples, 2))) + 16


def check_batch_size(batch_size: int, num_examples: int, what: str = "the split") -> None:
    """Raises ValueError unless 1 <= batch_size <= num_examples (no example twice per batch)."""
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if batch_size > num_examples:
        raise ValueError(
            f"batch_size={batch_size} is larger than {what} ({num_examples} examples): one "
            "batch would repeat examples; use a smaller batch or a larger dataset")


def _check_size(num_examples: int) -> None:  # K_r + N - x must fit in uint32
    if not 1 <= num_examples <= 2**31:
        raise ValueError(f"a split must have 1 to 2^31 examples, got {num_examples}")


@functools.partial(jax.jit, static_argnums=2)
def _epoch_keys_jax(seed: jax.Array, epoch: jax.Array, rounds: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), epoch)
    return jax.random.bits(key, (2, rounds), jnp.uint32)


@functools.lru_cache(maxsize=64)
def _epoch_keys(seed: int, epoch: int, rounds: int) -> np.ndarray:
    """Round keys uint32 [2, R] of epoch permutation π_epoch (from fold_in(key(seed), epoch))."""
    return np.asarray(_epoch_keys_jax(np.uint32(seed % 2**32), np.uint32(epoch % 2**32), rounds))


def _hash(xp, v):  # lowbias32 (C. Wellons, "Prospecting for hash functions", 2018)
    v = (v ^ (v >> 16)) * xp.uint32(0x7FEB352D)
    v = (v ^ (v >> 15)) * xp.uint32(0x846CA68B)
    return v ^ (v >> 16)


def _swap_or_not_round(xp, x_B, keys_Bx2, n):
    partner = (keys_Bx2[..., 0] % n + n - x_B) % n
    swap = (_hash(xp, xp.maximum(x_B, partner) ^ keys_Bx2[..., 1]) & 1) == 1
    return xp.where(swap, partner, x_B)


def _swap_or_not(xp, x_B, keys_Bx2xR, num_examples: int):
    """π(x) for x in [0, N): R swap-or-not rounds with (per-element) round keys."""
    n = xp.uint32(num_examples)
    x_B = x_B.astype(xp.uint32)
    if xp is np:
        for r in range(keys_Bx2xR.shape[-1]):
            x_B = _swap_or_not_round(np, x_B, keys_Bx2xR[..., r], n)
        return x_B
    # A rolled loop (partly unrolled) compiles several times faster than R unrolled rounds.
    body = lambda r, x: _swap_or_not_round(jnp, x, jnp.take(keys_Bx2xR, r, axis=-1), n)
    return jax.lax.fori_loop(0, keys_Bx2xR.shape[-1], body, x_B, unroll=8)


@functools.lru_cache(maxsize=4)
def _epoch_table(seed: int, epoch: int, num_examples: int) -> np.ndarray:
    keys = _epoch_keys(seed, epoch, _num_rounds(num_examples))
    return _swap_or_not(np, np.arange(num_examples, dtype=np.uint32), keys, num_examples)


def stream_indices_np(examples_seen: int, batch_size: int, num_examples: int, seed: int,
                      *, shuffle: bool = True) -> np.ndarray:
    """Example indices int64 [B] at stream positions [s, s + B) (host; exact Python ints)."""
    positions = int(examples_seen) + np.arange(batch_size, dtype=np.int64)
    return positions_to_indices_np(positions, num_examples, seed, shuffle=shuffle)


def positions_to_indices_np(positions: np.ndarray, num_examples: int, seed: int,
                            *, shuffle: bool = True) -> np.ndarray:
    """Example indices int64 for arbitrary stream positions (host)."""
    _check_size(num_examples)
    positions = np.asarray(positions, np.int64)
    if positions.size and positions.min() < 0:
        raise ValueError("stream positions must be >= 0")
    epoch, offset = np.divmod(positions, num_examples)
    if not shuffle:
        return offset
    out = np.empty(offset.shape, np.int64)  # π_epoch(offset), one epoch at a time
    for e in np.unique(epoch):
        sel = epoch == e
        if num_examples <= _TABLE_MAX:
            out[sel] = _epoch_table(int(seed), int(e), num_examples)[offset[sel]]
        else:
            keys = _epoch_keys(int(seed), int(e), _num_rounds(num_examples))
            out[sel] = _swap_or_not(np, offset[sel], keys, num_examples)
    return out


def stream_indices_jax(examples_seen: jax.Array | int, batch_size: int, num_examples: int,
                       seed: jax.Array | int, *, shuffle: bool = True) -> jax.Array:
    """Example indices int32 [B] at stream positions [s, s + B) (jittable; s may be traced).
    `batch_size` and `num_examples` are static; `examples_seen` is an int32 scalar (int64 when
    x64 is on), so on device s + B must stay below 2^31 without x64."""
    _check_size(num_examples)
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
    epoch_keys_fn = functools.partial(_epoch_keys_jax, rounds=_num_rounds(num_examples))
    keys_Kx2xR = jax.vmap(epoch_keys_fn, in_axes=(None, 0))(seed_u32, epochs_K)
    keys_Bx2xR = keys_Kx2xR[epoch - first]
    return _swap_or_not(jnp, offset, keys_Bx2xR, num_examples).astype(jnp.int32)


def stream_indices(examples_seen, batch_size: int, num_examples: int, seed,
                   *, shuffle: bool = True):
    """Example indices at stream positions [s, s + B): numpy for Python/numpy ints,
    jax (jittable) when `examples_seen` or `seed` is a jax array."""
    if isinstance(examples_seen, jax.Array) or isinstance(seed, jax.Array):
        return stream_indices_jax(examples_seen, batch_size, num_examples, seed, shuffle=shuffle)
    return stream_indices_np(examples_seen, batch_size, num_examples, seed, shuffle=shuffle)
