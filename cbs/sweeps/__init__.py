"""Batch-size sweeps: the trial grid (`grid`), running trials (`trials`, `groups`), the launcher
(`launch`), ramps beside a sweep (`ramps`), the reference-trajectory protocol (`reference`; over
seeds, `reference_seeds`) and branch studies (`branches`, `branch_config`, `branch_unit`,
`branch_noise`, `probe_runs`)."""

__all__ = [
    "branch_config", "branch_noise", "branch_unit", "branches", "grid", "groups", "launch",
    "probe_runs", "ramps", "reference", "reference_seeds", "trials",
]  # its modules
