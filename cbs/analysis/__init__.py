"""Fits, figures and reports from result files alone: no model, no training code. Modules:
`fit` (trade-off and power-law fits), `selection` (from trial records to fit points), `joint`
(intervals across targets), `edges` (learning-rate grids that bracket the optimum),
`noise_at_target` (the noise scale at a target loss), `report` (a sweep's analysis) and
`report_tables` (its tables), `plots` (figures), `payoff` (batch ramps against fixed batch
sizes), `branch_report` (local critical batch size from branches), `compare` (across
studies) and `sizes` (across model sizes).
"""

__all__ = [
    "branch_report", "compare", "edges", "fit", "joint", "noise_at_target", "payoff", "plots",
    "report", "report_tables", "selection", "sizes",
]  # its modules
