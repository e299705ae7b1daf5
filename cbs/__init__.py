"""cbs: critical batch size science in JAX.

Measure the gradient noise scale of a model (`cbs.noise`, `cbs.curvature`), train on device
meshes with the measurement inside the step (`cbs.train`), sweep batch sizes and fit the
critical batch size (`cbs.sweeps`, `cbs.fit`, `cbs.report`), and ramp the batch during
training (`cbs.schedules`).

Packages, lowest layer first (docs/design.md has the import rule):
`cbs.stats`, `cbs.data`, `cbs.results` → `cbs.models`, `cbs.analysis` → `cbs.engine` →
`cbs.sweeps` → `cbs.configs` (the presets) → `cbs.commands`. The top-level modules above are
stable public paths of modules in them.
"""

__version__ = "0.1.0"

__all__ = [  # the layer packages, the public modules and the install hint
    "analysis", "commands", "configs", "curvature", "data", "engine", "fit", "install_command",
    "models", "noise", "report", "results", "schedules", "stats", "sweeps", "train",
]


def install_command(extra: str) -> str:
    """The command that installs the optional extra `extra` (e.g. "tfds") for this copy of cbs:
    `pip install -e ".[tfds]"` when cbs runs from a source checkout (an editable install or
    the checkout on sys.path: a pyproject.toml of cbs-jax beside the package), else
    `pip install "cbs-jax[tfds]"` (an install from a wheel). Missing-extra errors name it."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            checkout = 'name = "cbs-jax"' in f.read()
    except OSError:
        checkout = False
    return f'pip install -e ".[{extra}]"' if checkout else f'pip install "cbs-jax[{extra}]"'
