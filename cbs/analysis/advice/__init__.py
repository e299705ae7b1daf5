"""The batch-size answer. Modules: `calibration`, `advice` (the answer built on it), `probe`
(the task's own ratio from short branches) and `probe_evidence` (that probe tested)."""

__all__ = ["advice", "calibration", "probe", "probe_evidence"]  # its modules
