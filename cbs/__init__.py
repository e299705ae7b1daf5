"""cbs: critical batch size science in JAX.

Measure the gradient noise scale of a model (`cbs.noise`, `cbs.curvature`), train on device
meshes with the measurement inside the step (`cbs.train`), sweep batch sizes and fit the
critical batch size (`cbs.sweep`, `cbs.fit`), and ramp the batch during training
(`cbs.schedules`).
"""

__version__ = "0.1.0"
