"""Sphinx configuration of the cbs documentation (Markdown pages through MyST, the API
reference from the docstrings). Build: python -m sphinx -W -b html docs docs/_build/html"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "cbs"
author = "cbs contributors"
copyright = "2026, cbs contributors"  # noqa: A001 (Sphinx's name)
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3
autodoc_default_options = {"members": True, "undoc-members": False}
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures carry them; jax/numpy types do not resolve
suppress_warnings = ["myst.header"]
html_theme = "alabaster"
html_title = "cbs: critical batch size science in JAX"


def _verbatim(app, what, name, obj, options, lines):
    """cbs docstrings are plain text with the papers' notation (|G|², tr(HΣ), B*, x_BxD),
    which reStructuredText would read as markup: show them as written, in a literal block."""
    if any(line.strip() for line in lines):
        lines[:] = ["::", ""] + [f"    {line}" for line in lines] + [""]


def setup(app):
    app.connect("autodoc-process-docstring", _verbatim)
