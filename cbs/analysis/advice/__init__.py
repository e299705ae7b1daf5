"""The batch-size answer. Modules: `calibration` (B_crit predicted from a noise scale,
calibrated on committed studies), `advice` (the batch-size answer built on it), `probe` (the
task's own ratio of local B_crit to the noise scale from short branches, combined with the
calibration) and `probe_evidence` (that probe on the committed branch studies).
"""

__all__ = ["advice", "calibration", "probe", "probe_evidence"]  # its modules
