"""Analyses across sweeps. Modules: `compare` (across studies), `sizes` (across model
sizes), `payoff` and `ramp_start` (batch ramps), `reference_protocol` (noise over seeds).
"""

__all__ = ["compare", "payoff", "ramp_start", "reference_protocol", "sizes"]  # its modules
