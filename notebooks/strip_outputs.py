"""Strips outputs, execution counts and run metadata from notebooks, in place.

    python notebooks/strip_outputs.py notebooks/*.ipynb

The notebooks are committed stripped (tests/test_notebooks.py checks it).
"""

from __future__ import annotations

import sys

import nbformat

RUN_METADATA = ("execution", "collapsed", "scrolled")  # per-cell keys a run adds


def strip(path: str) -> bool:
    """Strips one notebook; returns True if it changed."""
    nb = nbformat.read(path, as_version=4)
    before = nbformat.writes(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for key in RUN_METADATA:
            cell.metadata.pop(key, None)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    after = nbformat.writes(nb)
    if after != before:
        with open(path, "w", encoding="utf-8") as f:
            f.write(after)
    return after != before


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(("stripped " if strip(p) else "clean    ") + p)
