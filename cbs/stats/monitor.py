"""A noise-scale monitor for any training loop (docs/guides/measuring.md shows one in use).

Each call folds one batch's unbiased |G|² and tr(Σ) (and GᵀHG, tr(HΣ) when the statistics carry
them) into `cbs.stats.smoothing.NoiseScaleEMA` on the device. Every `every` calls the smoothed
values are read back once, appended to `history`, passed to `log` and written to `writer`
(anything with clu's `write_scalars(step, scalars)`, such as `cbs.results.writers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from cbs.stats.noise import NoiseStats
from cbs.stats.smoothing import NoiseScaleEMA

__all__ = ["NoiseMonitor"]


_fold = jax.jit(NoiseScaleEMA.update)


class NoiseMonitor:
    """Smoothed B_simple (and B_noise) of a running training loop (module docstring).

    Args:
      decay: EMA decay per update (0.95 averages about the last 20 batches).
      every: read back and log every this many updates (0: never log, read on demand).
      log: called as log(step, {"noise/ema_b_simple": ..., ...}) with host floats, step the
        one given to `update`, else the number of updates so far.
      writer: given the same values (write_scalars); the caller closes it.
    """

    def __init__(self, *, decay: float = 0.95, every: int = 100,
                 log: Callable[[int, dict[str, float]], Any] | None = None, writer: Any = None):
        if every < 0:
            raise ValueError(f"every must be >= 0, got {every}")
        if writer is not None and not callable(getattr(writer, "write_scalars", None)):
            raise TypeError("writer must have a write_scalars(step, scalars) method (a "
                            f"cbs.results.writers.MetricWriter), got {type(writer).__name__}")
        self.ema = NoiseScaleEMA.init(decay)
        self.every, self.log, self.writer, self.updates, self.step = every, log, writer, 0, 0
        self.history: list[tuple[int, dict[str, float]]] = []

    def update(self, stats: NoiseStats, *, step: int | None = None) -> None:
        """Folds one batch's statistics in; `step`: the training loop's step."""
        curv = stats.g_h_g is not None and stats.trace_h_sigma is not None
        self.ema = _fold(self.ema, stats.grad_sq_norm, stats.trace_sigma,
                         trace_h_sigma=stats.trace_h_sigma if curv else None,
                         g_h_g=stats.g_h_g if curv else None)
        self.updates += 1
        self.step = self.updates if step is None else int(step)
        if self.every and self.updates % self.every == 0:
            values = self.values()
            self.history.append((self.step, values))
            if self.log is not None:
                self.log(self.step, values)
            if self.writer is not None:
                self.writer.write_scalars(self.step, values)

    def values(self) -> dict[str, float]:
        """The smoothed statistics as host floats (`noise/ema_b_simple`, ...; NaN until fed)."""
        return {k: float(np.asarray(v)) for k, v in self.ema.to_dict().items()}

    @property
    def b_simple(self) -> float:
        return float(np.asarray(self.ema.b_simple))

    @property
    def b_noise(self) -> float:
        return float(np.asarray(self.ema.b_noise))
