"""The code blocks of README.md and the guides marked `<!-- runs as a test -->` run as they
stand (each in a fresh namespace): README's drop-in in an optax loop, and the drop-in snippets
of docs/guides/measuring.md for optax + plain JAX, NNX, a linen TrainState step and
equinox."""

import math
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARK = "<!-- runs as a test -->"
BLOCK = re.compile(re.escape(MARK) + r"\s*```python\n(.*?)```", re.S)


def _snippets():
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        for i, code in enumerate(BLOCK.findall(text)):
            out.append(pytest.param(code, id=f"{page.stem}-{i}"))
        assert text.count(MARK) == len(BLOCK.findall(text)), f"{page}: a marker without a block"
    return out


def test_the_measuring_guide_has_the_four_loops():
    assert len([s for s in _snippets() if s.id.startswith("measuring-")]) == 4


@pytest.mark.parametrize("code", _snippets())
def test_snippet_runs(code, capsys):
    exec(compile(code, "<guide snippet>", "exec"), {"__name__": "__guide__"})
    printed = capsys.readouterr().out.split()
    values = [float(v) for k, v in zip(printed, printed[1:], strict=False) if k.startswith("B_")]
    assert values and all(math.isfinite(v) for v in values), printed
