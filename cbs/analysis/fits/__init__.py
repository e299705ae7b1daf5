"""From trial records to fits. Modules: `selection` (from trial records to fit points),
`fit` (trade-off and power-law fits), `joint` (intervals across targets), `edges`
(learning-rate grids that bracket the optimum), `held_out` (rates selected on one seed, steps
measured on the others), `misfit` (the calibrated test of one power law), `anchor` (the
linear-regression anchor in closed form), `noise_at_target` (the noise scale at a target
loss).
"""

__all__ = [
    "anchor", "edges", "fit", "held_out", "joint", "misfit", "noise_at_target", "selection",
]  # its modules
