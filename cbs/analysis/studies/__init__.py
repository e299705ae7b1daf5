"""Analyses across sweeps. Modules: `compare` (across studies), `sizes` (across model
sizes), `payoff` (batch ramps against fixed batch sizes), `ramp_start` (a ramp against the
fixed run at its first batch), `reference_protocol` (the noise scale at each target on the
reference trajectory over seeds).
"""

__all__ = ["compare", "payoff", "ramp_start", "reference_protocol", "sizes"]  # its modules
