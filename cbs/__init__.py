"""cbs: critical batch size science in JAX.

Measure the gradient noise scale of a model (`cbs.noise`, `cbs.curvature`), train on device meshes
with the measurement inside the step (`cbs.train`), sweep batch sizes and fit the critical batch
size (`cbs.sweeps`, `cbs.fit`, `cbs.report`), and ramp the batch during training (`cbs.schedules`).

Packages, lowest layer first (docs/design.md has the import rule): `cbs.stats`, `cbs.results`
→ `cbs.data`, `cbs.models`, `cbs.analysis` → `cbs.runtime` (the engine's plumbing) →
`cbs.engine` → `cbs.sweeps` → `cbs.configs` (the presets) → `cbs.commands`. The top-level
modules above are stable public paths of modules in them.
"""

__version__ = "0.1.0"

__all__ = [  # the layer packages and the public modules
    "analysis", "commands", "configs", "curvature", "data", "engine", "fit", "models", "noise",
    "report", "results", "runtime", "schedules", "stats", "sweeps", "train",
]

