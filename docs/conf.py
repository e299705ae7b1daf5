"""Sphinx configuration of the cbs documentation (Markdown pages through MyST, the API
reference from the docstrings). Build: python -m sphinx -W -b html docs docs/_build/html"""

import importlib
import inspect
import os
import re
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
autodoc_default_options = {"members": True, "undoc-members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures carry them; jax/numpy types do not resolve
suppress_warnings = ["myst.header"]
html_theme = "alabaster"
html_title = "cbs: critical batch size science in JAX"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(\(\))?")
_SPECIAL = re.compile(r"([\\*_|`])")


def _target(name: str) -> str:
    """Where a dotted cbs name is documented: its one public path, the module that defines it
    (`cbs.train.run` -> `cbs.engine.trainer.run`: the façades are documented through the
    modules they re-export) or the package whose `__all__` lists it in place of that module
    (`cbs.data.Dataset`, defined in `cbs.data.dataset`)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        module = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None)
        if obj is not None and module and qualname and module.startswith("cbs"):
            return f"{_public_module(module, qualname.split('.')[0])}.{qualname}"
        return name
    return name


def _public_module(module: str, name: str) -> str:
    """`module`, or the package above it whose `__all__` lists `name` where `module`'s does
    not (one public path per name, tests/test_architecture.py)."""
    where = module
    while where.count("."):
        if name in getattr(sys.modules.get(where), "__all__", ()):
            return where
        where = where.rsplit(".", 1)[0]
    return module


def _code(text: str) -> str:
    """A backquoted span: a cross-reference when it is a Python name (a cbs name linked where
    it is defined), else inline code."""
    if _NAME.fullmatch(text) and not text.isdigit():
        name = text.removesuffix("()")
        target = _target(name) if name.startswith("cbs.") else name
        shown = text.replace("<", r"\<")
        return (rf"\ :py:obj:`{shown} <{target}>`\ " if target != name
                else rf"\ :py:obj:`{shown}`\ ")
    return rf"\ ``{text.strip()}``\ " if text.strip() else ""


def _inline(line: str) -> str:
    """One line of plain docstring text as reStructuredText: markup characters escaped (the
    papers' notation, |G|², B*, x_BxD, is text), backquoted spans as references or code."""
    pieces = line.split("`")
    if len(pieces) % 2 == 0:  # an unpaired backquote: all text
        return _SPECIAL.sub(r"\\\1", line)
    return "".join(_code(p) if i % 2 else _SPECIAL.sub(r"\\\1", p) for i, p in enumerate(pieces))


def _paragraphs(lines: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            out[-1].append(line.rstrip())
        elif out[-1]:
            out.append([])
    return [p for p in out if p]


def _render(app, what, name, obj, options, lines):
    """cbs docstrings are plain text with the papers' notation and `name` spans. Each
    paragraph keeps its lines (a line block, indentation kept); an indented paragraph (a
    command, formulas) is a literal block; `cbs.x.y` and other Python names link to their
    documentation."""
    out: list[str] = []
    for para in _paragraphs(lines):
        if all(line.startswith("    ") for line in para):
            out += ["::", ""] + [f"    {line}" for line in para] + [""]
            continue
        for line in para:
            indent = len(line) - len(line.lstrip())
            out.append("| " + "\u00a0" * indent + _inline(line.strip()))
        out.append("")
    if what == "module":
        out += _constants(name, obj)
    lines[:] = out


def _constants(module_name: str, module) -> list[str]:
    """Entries for the constants and type aliases in a module's `__all__` (autodoc documents
    only those with a `#:` comment): each as `py:data` with its value."""
    from sphinx.pycode import ModuleAnalyzer
    try:
        commented = {n for _, n in ModuleAnalyzer.for_module(module_name).find_attr_docs()}
    except Exception:
        commented = set()
    own = set(getattr(module, "__all__", ()))
    if hasattr(module, "__path__"):  # a package: only what it defines itself, no submodule
        where = os.path.dirname(module.__file__)
        own = {n for n in own if not os.path.exists(os.path.join(where, f"{n}.py"))
               and getattr(getattr(module, n, None), "__module__", module_name) == module_name}
    out = []
    for n in getattr(module, "__all__", ()):
        value = getattr(module, n, None)
        if (n not in own or n in commented or inspect.isroutine(value)
                or isinstance(value, type) or inspect.ismodule(value)
                or f"{module_name}.{n}" in sys.modules):
            continue
        text = " ".join(repr(value).split())
        text = text if len(text) <= 90 else text[:87] + "..."
        out += [f".. py:data:: {n}", f"   :value: {text}", ""]
    return out


def setup(app):
    app.connect("autodoc-process-docstring", _render)
