"""Batch-size schedules in examples seen: host-side Python, since B sets the static number of
accumulation steps (an `int` chosen outside `jit`).

Letters: e examples (or tokens) seen so far, B the global (logical) batch size, T tokens per
sequence. A language-model example is a sequence of T tokens, so tokens seen = T·e exactly:
schedules written in tokens run in sequences through `in_sequences(schedule, T)` or
`llama3_schedule(tokens_per_unit=T)`. Host counters are Python ints (no overflow); the
device counter's float (`cbs.engine.state`) reaches only the learning-rate schedule.

`Constant`, `Step` and `Linear` depend on e alone; `Adaptive` (`cbs.engine.adaptive`) follows
the live noise scale. Every schedule follows the protocol of `_Static`, so the loop has one
code path. The learning rate that goes with B is `cbs.engine.lr`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from cbs.engine.adaptive import Adaptive
from cbs.runtime import fields

__all__ = [
    "BatchSchedule", "Constant", "Linear", "Step",
    "batch_schedule_from_config", "batch_size_trace", "checked_schedule", "deepseek_v3_schedule",
    "in_sequences", "llama3_schedule", "register", "validate_batch_config",
]


def _round_to_multiple(x: float, multiple: int) -> int:
    return int(multiple * math.floor(x / multiple + 0.5))


class _Static:
    """The protocol every schedule follows, as no-ops for those that depend on e only:
    `observes` names the smoothed noise scale the schedule wants fed to `update` every
    `batch.adapt_every` steps (None: none); `init`/`update`/`state_from_dict` carry its state;
    `batch_size_at(e, state)` is B; `planning_batch_size(e)` is B without a state (for
    prefetching); `batch_sizes()` is every B it can produce (for validation)."""

    observes: str | None = None
    batch_size_at: Callable[..., int]  # B(e, state), defined by each schedule

    def init(self) -> None:
        return None

    def update(self, state: Any, noise_scale: float, examples_seen: float) -> None:
        del noise_scale, examples_seen
        return state

    def state_from_dict(self, raw: Mapping[str, Any] | None) -> None:
        del raw
        return None

    def planning_batch_size(self, examples_seen: float) -> int:
        return self.batch_size_at(examples_seen, None)


@dataclasses.dataclass(frozen=True)
class Constant(_Static):
    """B(e) = batch_size."""

    batch_size: int

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    def batch_size_at(self, examples_seen: float, state: Any = None) -> int:
        return int(self.batch_size)

    def batch_sizes(self) -> tuple[int, ...]:
        return (int(self.batch_size),)

    @classmethod
    def from_config(cls, c: Mapping[str, Any]) -> Constant:
        return cls(int(fields.lookup(c, "batch_size", "batch_schedule")))


@dataclasses.dataclass(frozen=True)
class Step(_Static):
    """B(e) = B_i for the last i with e ≥ e_i; `steps` = ((0, B_0), (e_1, B_1), ...)."""

    steps: tuple[tuple[int, int], ...]

    def __post_init__(self):
        steps = tuple((int(t), int(b)) for t, b in self.steps)
        object.__setattr__(self, "steps", steps)
        if not steps or steps[0][0] != 0:
            raise ValueError("Step.steps must start with (0, batch_size)")
        thresholds = [t for t, _ in steps]
        if any(b <= a for a, b in zip(thresholds, thresholds[1:], strict=False)):
            raise ValueError(f"Step thresholds must increase strictly, got {thresholds}")
        if any(b < 1 for _, b in steps):
            raise ValueError("Step batch sizes must be >= 1")

    def batch_size_at(self, examples_seen: float, state: Any = None) -> int:
        return next((b for t, b in reversed(self.steps) if examples_seen >= t),
                    self.steps[0][1])

    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(b for _, b in self.steps)

    def scaled(self, *, examples: float = 1.0, batch: float = 1.0, multiple: int = 1) -> Step:
        """Same shape with thresholds × `examples` and sizes × `batch` (rounded, ≥ multiple)."""
        return Step(tuple(
            (round(t * examples), max(multiple, _round_to_multiple(b * batch, multiple)))
            for t, b in self.steps))

    @classmethod
    def from_config(cls, c: Mapping[str, Any]) -> Step:
        return cls(tuple(tuple(s) for s in fields.lookup(c, "steps", "batch_schedule")))


@dataclasses.dataclass(frozen=True)
class Linear(_Static):
    """B(e) = start + (end − start)·min(e/over, 1), rounded to the nearest `multiple`."""

    start: int
    end: int
    over: float
    multiple: int = 1

    def __post_init__(self):
        if self.multiple < 1 or self.start % self.multiple or self.end % self.multiple:
            raise ValueError(f"Linear start={self.start} and end={self.end} must be multiples "
                             f"of multiple={self.multiple} (micro_batch × data_replicas)")
        if self.over <= 0 or min(self.start, self.end) < 1:
            raise ValueError("Linear needs over > 0 and start, end >= 1")

    def batch_size_at(self, examples_seen: float, state: Any = None) -> int:
        frac = min(max(float(examples_seen), 0.0) / self.over, 1.0)
        raw = self.start + (self.end - self.start) * frac
        b = _round_to_multiple(raw, self.multiple)
        return int(min(max(b, min(self.start, self.end)), max(self.start, self.end)))

    def batch_sizes(self) -> tuple[int, ...]:
        lo, hi = sorted((self.start, self.end))
        return tuple(range(lo, hi + 1, self.multiple))

    def scaled(self, *, examples: float = 1.0, batch: float = 1.0,
               multiple: int | None = None) -> Linear:
        """Same shape with `over` × `examples` and sizes × `batch` (rounded to `multiple`)."""
        m = self.multiple if multiple is None else multiple
        size = lambda b: max(m, _round_to_multiple(b * batch, m))
        return Linear(size(self.start), size(self.end), self.over * examples, m)

    @classmethod
    def from_config(cls, c: Mapping[str, Any]) -> Linear:
        w = "batch_schedule"
        return cls(int(fields.lookup(c, "start", w)), int(fields.lookup(c, "end", w)),
                   float(fields.lookup(c, "over", w)), int(fields.lookup(c, "multiple", w, 1)))


BatchSchedule = Constant | Step | Linear | Adaptive
_SCHEDULES: dict[str, Any] = {"constant": Constant, "step": Step, "linear": Linear,
                               "adaptive": Adaptive}


def register(kind: str, cls: type) -> type:
    """Registers a batch-size schedule class under `kind` (`batch.schedule.kind`): one with
    `from_config` (of the `batch.schedule` fields as a plain mapping) and `_Static`'s protocol."""
    if kind in _SCHEDULES:
        raise ValueError(f"batch schedule kind {kind!r} is already registered")
    _SCHEDULES[kind] = cls
    return cls


def batch_schedule_from_config(config: Any, *, optimizer: str | None = None
                               ) -> BatchSchedule:
    """The schedule of a config whose `kind` is registered (the other fields: the class's
    own); errors name the missing field. optimizer: the run's `config.optim.name`, for a
    calibrated adaptive schedule that names none."""
    c = fields.as_mapping(config)
    kind = fields.lookup(c, "kind", "batch_schedule")
    if kind not in _SCHEDULES:
        raise ValueError(f"batch_schedule.kind={kind!r}: expected one of {sorted(_SCHEDULES)}")
    if optimizer is not None and kind == "adaptive" and c.get("optimizer") is None:
        c = dict(c) | {"optimizer": optimizer}
    return _SCHEDULES[kind].from_config(c)


def checked_schedule(schedule_config: Any, *, optimizer: str | None = None) -> BatchSchedule:
    """`batch_schedule_from_config`, its error a `fields.ConfigError` (`config.batch.schedule`)."""
    try:
        return batch_schedule_from_config(schedule_config, optimizer=optimizer)
    except (ValueError, TypeError, KeyError) as err:
        raise fields.ConfigError(f"config.batch.schedule: {err}") from err


def validate_batch_config(batch_config: Any, *, optimizer: str | None = None
                          ) -> BatchSchedule:
    """Checks `config.batch` but its `lr_coupling`; returns the schedule. Raises
    `fields.ConfigError`. optimizer: `config.optim.name`."""
    at = "config.batch"
    fields.integer(batch_config, "micro_batch", at)
    schedule = checked_schedule(fields.get(batch_config, "schedule", at), optimizer=optimizer)
    fields.integer(batch_config, "adapt_every", at)
    return schedule

def llama3_schedule(*, tokens_per_unit: int = 1) -> Step:
    """Llama 3 405B pre-training batch schedule, in tokens (Llama Team 2024, §3.4.1).

    "an initial batch size of 4M tokens and sequences of length 4,096, and double these values
    to a batch size of 8M sequences of 8,192 tokens after pre-training 252M tokens. We double
    the batch size again to 16M after pre-training on 2.87T tokens." Sizes are read as
    1024 × 4096, 1024 × 8192 and 2048 × 8192 tokens; thresholds as 252·10^6 and 2.87·10^12.
    `tokens_per_unit` divides both (e.g. 8192 to count 8192-token sequences); thresholds are
    rounded up, so the batch changes on the first unit count whose tokens reach them.
    """
    mi = 2 ** 20
    steps = ((0, 4 * mi), (252_000_000, 8 * mi), (2_870_000_000_000, 16 * mi))
    u = tokens_per_unit
    return Step(tuple((-(-t // u), b // u) for t, b in steps))


def in_sequences(schedule: BatchSchedule, seq_len: int) -> BatchSchedule:
    """A static schedule in tokens (thresholds and sizes) as one in sequences of T =
    `seq_len`: sizes B/T (each must divide exactly), thresholds rounded up (B changes on the
    first step whose tokens seen reach a threshold)."""
    def size(b: int) -> int:
        if b % seq_len:
            raise ValueError(f"batch size {b} tokens is not a multiple of seq_len={seq_len}")
        return b // seq_len

    if isinstance(schedule, Constant):
        return Constant(size(schedule.batch_size))
    if isinstance(schedule, Step):
        return Step(tuple((-(-t // seq_len), size(b)) for t, b in schedule.steps))
    if isinstance(schedule, Linear):
        return Linear(size(schedule.start), size(schedule.end), schedule.over / seq_len,
                      max(1, schedule.multiple // seq_len))
    raise ValueError(f"in_sequences: {type(schedule).__name__} is not a static schedule")


def deepseek_v3_schedule(*, seq_len: int = 4096, unit: str = "sequences",
                         multiple: int = 1) -> Linear:
    """DeepSeek-V3 batch ramp (DeepSeek-AI 2024, arXiv:2412.19437, §4.2 hyper-parameters).

    "the batch size is gradually increased from 3072 to 15360 in the training of the first
    469B tokens, and then keeps 15360": sequences of 4096 tokens. The report does not say how
    the ramp is discretised; this is linear in tokens, rounded to `multiple` sequences.
    unit="sequences": e and B count sequences; unit="tokens": both count tokens.
    """
    over_tokens = 469_000_000_000
    if unit == "sequences":
        return Linear(3072, 15360, over_tokens / seq_len, multiple)
    if unit == "tokens":
        return Linear(3072 * seq_len, 15360 * seq_len, over_tokens, multiple * seq_len)
    raise ValueError(f"unit must be 'sequences' or 'tokens', got {unit!r}")


def batch_size_trace(schedule: BatchSchedule, total_examples: float,
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Walks a static schedule step by step: (e at the start of each step, B of that step)."""
    starts, sizes, e = [], [], 0
    while e < total_examples:
        b = schedule.batch_size_at(e)
        starts.append(e)
        sizes.append(b)
        e += b
    return np.asarray(starts, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
