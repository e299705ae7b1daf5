"""From trial records to fits. Modules: `selection`, `fit`, `joint`, `edges`, `held_out`,
`misfit`, `anchor` (the linear-regression anchor in closed form), `noise_at_target`."""

__all__ = [
    "anchor", "edges", "fit", "held_out", "joint", "misfit", "noise_at_target", "selection",
]  # its modules
