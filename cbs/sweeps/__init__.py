"""Batch-size sweeps: the trial grid (`grid`), running trials (`trials`, `groups`), the noise
measurement both trial runners record (`measurement`), the launcher (`launch`), batch-size
ramps beside a sweep (`ramps`), the reference-trajectory protocol (`reference`) and branch
studies (`branches`, one unit of which is `branch_unit`, with the reference run's noise in
`branch_noise`).
"""

__all__ = [
    "branch_noise", "branch_unit", "branches", "grid", "groups", "launch", "measurement",
    "ramps", "reference", "trials",
]  # its modules
