"""Fits, figures and reports from result files alone: no model, no training code. Its
subpackages, lowest first (each imports only those before it):

- `fits`: from trial records to fitted trade-offs and intervals;
- `reports`: a sweep's tables, figures and report, and a branch study's;
- `advice`: B_crit predicted from a noise scale, calibrated on committed studies, and the
  batch-size answer built on it;
- `studies`: analyses across sweeps (studies, model sizes, batch ramps, the reference
  protocol).
"""

__all__ = ["advice", "fits", "reports", "studies"]  # its subpackages
