"""The training engine: one run from a config, and the one loop that drives it. Modules:

- the core: `config` (defaults and start-up validation), `fields` (the field checks and
  `ConfigError`), `spec` (a run as a base config plus typed overrides), `parts` (`RunParts`,
  built once from a config), `state` (what the step carries and returns: the train
  state, its exact example counts, the packed metrics), `step` (the pure jitted train step),
  `vmapped` (many states as one vmapped program), `loop` (the one host
  loop), `driver` (what it drives), `trainer` (a run in a run directory), `progress` (loss
  EMA, divergence rule, evaluation points);
- the maths it trains with: `lr` (learning-rate coupling and schedules), `schedules`
  (batch-size schedules) and `adaptive` (the one that follows the noise scale), `optim`
  (optimizers);
- the noise it measures: `live_noise` (the step's live estimate), `noise_spec` (the one
  reading of `config.noise`), `measure` (the one call every path measures through, and a
  run's `Measurement`, the loop's one measuring event), `live_advice` (the calibrated
  batch-size advice each record logs from the live estimate);
- runtime plumbing: `mesh` (device mesh and shardings), `checkpoint` (orbax), `writer`
  (a run's records and their TensorBoard and W&B mirrors, progress bars), `throughput`
  (tokens/s, MFU), `preemption` (SIGTERM and Ctrl-C), `distributed` (multi-host start-up),
  `cli` (entry-point plumbing).
"""

__all__ = [
    "adaptive", "checkpoint", "cli", "config", "distributed", "driver", "fields", "live_advice",
    "live_noise", "loop", "lr", "measure", "mesh", "noise_spec", "optim", "parts", "preemption",
    "progress", "schedules", "spec", "state", "step", "throughput", "trainer", "vmapped",
    "writer",
]  # its modules
