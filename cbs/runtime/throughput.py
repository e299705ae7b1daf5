"""Throughput of a run: tokens/s, examples/s, step time and model FLOPs utilisation (MFU).

    MFU = (model FLOPs per example × examples per second) / (peak FLOP/s per device × devices)

Model FLOPs are the matmul FLOPs of the model as written (6·N per token plus attention, Kaplan et
al. 2020 §2.1), so rematerialisation, the noise estimate and padding count as overhead. Peaks
(`_PEAK_FLOPS`) are dense bfloat16 per device from data sheets; an unknown device (any CPU) gives no
MFU. Timing is on the host between metric reads (`Meter`): each train record of a read window gets
the window's mean step time; the first (compilation) is untimed. Also here, set by `config.perf`: a
`jax.profiler` trace window and the compilation cache.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax

from cbs.models import registry
from cbs.runtime import fields

__all__ = [
    "Meter", "Perf", "ProfileWindow", "enable_compilation_cache", "for_run",
    "model_flops_per_example", "peak_flops", "rates", "validate_config",
]

# By a substring of `jax.Device.device_kind`, first match; TPU: a chip (v4/v5p megacore: one).
_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("TPU v6 lite", 918e12), ("TPU v6e", 918e12), ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12), ("TPU v5p", 459e12), ("TPU v5", 459e12), ("TPU v4", 275e12),
    ("TPU v3", 123e12), ("TPU v2", 45e12),
    ("B200", 2250e12), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12),
    ("GH200", 989e12), ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12),
    ("A10G", 70e12), ("V100", 125e12),
)


def validate_config(perf_config: Any) -> None:
    """Checks `config.perf` (peak_flops, profile_start, profile_steps)."""
    fields.number(perf_config, "peak_flops", "config.perf")
    fields.integer(perf_config, "profile_start", "config.perf", minimum=-1)
    fields.integer(perf_config, "profile_steps", "config.perf")


def peak_flops(device: jax.Device | None = None) -> float | None:
    """Peak FLOP/s of `device` (default: the first device); None when unknown (CPU)."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return None
    kind = device.device_kind.lower()
    return next((flops for name, flops in _PEAK_FLOPS if name.lower() in kind), None)


def model_flops_per_example(config: Any, input_shape: tuple[int, ...],
                            vocab_size: int | None) -> float | None:
    """`cbs.models.registry.flops_per_example` (None for architectures without a formula)."""
    return registry.flops_per_example(
        config.model, registry.ModelInputs(tuple(input_shape), None, vocab_size))


def rates(examples: int, seconds: float, steps: int, *, tokens_per_example: int = 1,
          flops_per_example: float | None = None, peak: float | None = None,
          devices: int = 1) -> dict[str, float]:
    """perf/* of `steps` steps that consumed `examples` in `seconds`: examples/s, tokens/s,
    step time (s) and, when both FLOPs and the peak are known, MFU in [0, 1]."""
    out = {"perf/step_time_s": seconds / max(steps, 1), "perf/examples_per_s": examples / seconds,
           "perf/tokens_per_s": examples * tokens_per_example / seconds}
    if flops_per_example and peak:
        out["perf/mfu"] = flops_per_example * examples / seconds / (peak * devices)
    return out


class Meter:
    """Adds perf/* (and data/tokens_seen) to train records, timed between metric reads."""

    def __init__(self, *, tokens_per_example: int = 1, flops_per_example: float | None = None,
                 peak: float | None = None, devices: int = 1):
        self.tokens_per_example, self.flops = tokens_per_example, flops_per_example
        self.peak, self.devices = peak, devices
        self._last: tuple[float, int, int] | None = None  # (time, step, examples) at last read

    def annotate(self, records: list[dict[str, Any]]) -> None:
        """Adds fields in place to the train records just read (in step order)."""
        train = [r for r in records if r.get("kind") == "train"]
        if not train:
            return
        now, end = time.perf_counter(), train[-1]
        end_step = end["step"] + 1
        end_examples = end["data/examples_seen"] + end.get("data/batch_size", 0)
        for r in train:
            r["data/tokens_seen"] = r["data/examples_seen"] * self.tokens_per_example
        if self._last is not None and now > self._last[0]:
            t0, s0, e0 = self._last
            perf = rates(end_examples - e0, now - t0, end_step - s0,
                         tokens_per_example=self.tokens_per_example,
                         flops_per_example=self.flops, peak=self.peak, devices=self.devices)
            for r in train:
                r.update(perf)
        self._last = (now, end_step, end_examples)


class ProfileWindow:
    """A `jax.profiler` trace of steps [start, start + steps) written to `logdir`."""

    def __init__(self, start: int, steps: int, logdir: str):
        self.start, self.stop, self.logdir = start, start + steps, logdir
        self.active = False

    def at_step(self, step: int) -> None:
        """Call before dispatching step `step` (host int; a negative `start`: never)."""
        if step == self.start and not self.active:
            jax.profiler.start_trace(self.logdir)
            self.active = True
        elif step == self.stop and self.active:
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def enable_compilation_cache(directory: str) -> None:
    """Persists compiled programs in `directory` (local or gs://) across runs."""
    if directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@dataclasses.dataclass
class Perf:
    """The host loop's calls: `at_step(t)` before a dispatch, `annotate(records)` after a read."""

    meter: Meter | None
    profile: ProfileWindow

    def at_step(self, step: int) -> None:
        self.profile.at_step(step)

    def annotate(self, records: list[dict[str, Any]]) -> None:
        if self.meter is not None:
            self.meter.annotate(records)

    def close(self) -> None:
        self.profile.close()


def for_run(config: Any, workdir: str, dataset: Any = None, mesh: Any = None) -> Perf:
    """`Perf` from `config.perf` (absent fields: everything off) for a run on `dataset` (a
    `cbs.data.Dataset`, its shapes; None: none known) and `mesh` (None: all devices)."""
    p = config.get("perf", None) or {}
    enable_compilation_cache(p.get("compilation_cache_dir", ""))
    meter = None
    if p.get("records", False):
        input_shape = () if dataset is None else tuple(dataset.input_shape)
        vocab_size = None if dataset is None else dataset.vocab_size
        lm_task = vocab_size is not None and len(input_shape) == 1
        meter = Meter(tokens_per_example=int(input_shape[-1]) if lm_task else 1,
                      flops_per_example=model_flops_per_example(config, input_shape, vocab_size),
                      peak=p.get("peak_flops", 0.0) or peak_flops(),
                      devices=jax.device_count() if mesh is None else mesh.size)
    profile = ProfileWindow(p.get("profile_start", -1), p.get("profile_steps", 5),
                            os.path.join(workdir, "profile"))
    return Perf(meter, profile)
