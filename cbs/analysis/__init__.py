"""Fits, figures and reports from result files alone: no model, no training code. Modules:
`fit` (trade-off and power-law fits), `selection` (from trial records to fit points), `joint`
(intervals across targets), `edges` (learning-rate grids that bracket the optimum),
`noise_at_target` (the noise scale at a target loss), `reference_protocol` (the noise scale
at each target on the reference trajectory over seeds), `held_out` (rates selected on one
seed, steps measured on the others), `ramp_start` (a ramp against the fixed run at its first
batch), `report` (a sweep's analysis) and
`report_tables` (its tables), `plots` (figures), `payoff` (batch ramps against fixed batch
sizes), `branch_report` (local critical batch size from branches), `compare` (across
studies) and `sizes` (across model sizes), `misfit` (the calibrated test of one power law),
`anchor` (the linear-regression anchor in closed form), `calibration` (B_crit predicted from a
noise scale, calibrated on committed studies), `advice` (the batch-size answer built on
it), `probe` (the task's own ratio of local B_crit to the noise scale from short branches,
combined with the calibration) and `probe_evidence` (that probe on the committed branch
studies).
"""

__all__ = [
    "advice", "anchor", "branch_report", "calibration", "compare", "edges", "fit", "held_out",
    "joint", "misfit", "noise_at_target", "payoff", "plots", "probe", "probe_evidence",
    "ramp_start", "reference_protocol",
    "report",
    "report_tables", "selection", "sizes",
]  # its modules
