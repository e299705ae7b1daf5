"""The training core: one run from a config, and the one loop that drives it (its plumbing,
devices, files, signals, flags, is `cbs.runtime`). Modules:

- the run: `config` (defaults and start-up validation), `spec` (a run as a base config plus
  typed overrides), `parts` (`RunParts`, built once from a config), `state` (what the step
  carries and returns: the train state, its exact example counts, the packed metrics),
  `step` (the pure jitted train step), `vmapped` (many states as one vmapped program), `loop`
  (the one host loop), `driver` (what it drives), `trainer` (a run in a run directory);
- the maths it trains with: `lr` (learning-rate coupling and schedules), `schedules`
  (batch-size schedules) and `adaptive` (the one that follows the noise scale), `optim`
  (optimizers);
- the noise it measures: `live_noise` (the step's live estimate), `noise_spec` (the one
  reading of `config.noise`), `measure` (the one call every path measures through, and a
  run's `Measurement`, the loop's one measuring event), `live_advice` (the calibrated
  batch-size advice each record logs from the live estimate).
"""

__all__ = [
    "adaptive", "config", "driver", "live_advice", "live_noise", "loop", "lr", "measure",
    "noise_spec", "optim", "parts", "schedules", "spec", "state", "step", "trainer", "vmapped",
]  # its modules
