"""Batch-size sweeps: the trial grid (`grid`), running trials (`trials`, `groups`), the
launcher (`launch`), batch-size ramps beside a sweep (`ramps`), the reference-trajectory
protocol (`reference`; over seeds on a committed study, with the noise scale of Adam's update,
`reference_seeds`) and branch studies (`branches`, their config in `branch_config`, one unit of
which is `branch_unit`, with the reference run's noise in `branch_noise`; the probe's branches
from any run's checkpoint in `probe_runs`); every trial runner
records the one noise measurement of `cbs.engine.measure`."""

__all__ = [
    "branch_config", "branch_noise", "branch_unit", "branches", "grid", "groups", "launch",
    "probe_runs", "ramps", "reference", "reference_seeds", "trials",
]  # its modules
