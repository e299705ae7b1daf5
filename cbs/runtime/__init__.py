"""The engine's plumbing: what a run needs from its machine, not from the maths. Modules:
`fields` (config field checks and `ConfigError`), `mesh` (device mesh and shardings),
`checkpoint` (orbax), `writer` (a run's records and their TensorBoard and W&B mirrors, progress
bars), `throughput` (tokens/s, MFU, profiles), `progress` (loss EMA, divergence rule,
evaluation points), `preemption` (SIGTERM and Ctrl-C), `distributed` (multi-host start-up),
`cli` (entry-point plumbing). It sits below `cbs.engine`: nothing here imports the training core.
"""

__all__ = [
    "checkpoint", "cli", "distributed", "fields", "mesh", "preemption", "progress",
    "throughput", "writer",
]  # its modules
