"""Fits, figures and reports from result files alone: no model, no training code. Subpackages,
lowest first (each imports only those before it): `fits` (trial records to fits and
intervals), `reports` (a sweep's and a branch study's), `advice` (B_crit from a noise scale)
and `studies` (analyses across sweeps).
"""

__all__ = ["advice", "fits", "reports", "studies"]  # its subpackages
