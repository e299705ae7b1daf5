"""The training core: one run from a config, and the one loop that drives it (its plumbing,
devices, files, signals, flags, is `cbs.runtime`). Modules: `config` (defaults, validation),
`spec` (a run as a base config plus overrides), `parts` (`RunParts`, built once from a
config), `state` (what the step carries and returns), `step` (the jitted train step),
`vmapped` (many states as one program), `loop` (the one host loop), `driver` (what it
drives), `trainer` (a run in a run directory); `lr`, `schedules` and `adaptive` (learning-rate
and batch-size schedules), `optim` (optimizers); `live_noise` (the step's live estimate),
`noise_spec` (the one reading of `config.noise`), `measure` (the one measurement call and a
run's `Measurement`), `live_advice` (the batch-size advice each record logs).
"""

__all__ = [
    "adaptive", "config", "driver", "live_advice", "live_noise", "loop", "lr", "measure",
    "noise_spec", "optim", "parts", "schedules", "spec", "state", "step", "trainer", "vmapped",
]  # its modules
