"""Writes docs/api.md, the API reference, from the library's packages: a section per layer
package (its docstring, and its own names where its `__all__` lists any), one per module (its
`__all__`), and the façades' sources from their imports. Run: python docs/api_page.py
(tests/test_docs.py checks the committed page is what this writes)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "api.md"
LAYERS = {  # lowest first, as the import rule of docs/design.md orders them
    "stats": "Statistics", "data": "Data", "results": "Result files", "models": "Models",
    "analysis": "Analysis", "runtime": "Training plumbing", "engine": "Training engine",
    "sweeps": "Sweeps", "configs": "Presets",
}
FACADES = ["noise", "curvature", "fit", "report", "schedules", "train"]

HEAD = """# API reference

Every module's `__all__` is its public API, and every module is documented here (this page is
written by `python docs/api_page.py` from the packages). Each public name has one path,
documented once: the module that defines it, or, for the few names a package's own
`__all__` lists (those of `cbs.data` and `cbs.models` the guides import, such as
`cbs.data.Dataset`), that package in place of its module; every other name of a package's
modules is imported from the module (`from cbs.data.batching import host_batch`). The public
modules {facades} re-export exactly the `__all__` of the modules they name:

{sources}

The command-line programs (`cbs.commands`) are described by `--help` and the guides.
"""


def _all(path: pathlib.Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def _facade_sources() -> dict[str, list[str]]:
    out = {}
    for name in FACADES:
        tree = ast.parse((ROOT / "cbs" / f"{name}.py").read_text())
        out[name] = [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module]
    return out


def _block(module: str, options: str = "") -> str:
    return f"```{{eval-rst}}\n.. automodule:: {module}\n{options}```\n"


def _package(directory: pathlib.Path, title: str, re_exported: dict[str, str]) -> list[str]:
    """The sections of one package: its own, then its modules', then its subpackages'."""
    dotted = ".".join(directory.relative_to(ROOT).parts)
    children = {p.stem for p in directory.glob("*.py") if p.name != "__init__.py"}
    subpackages = sorted(d.name for d in directory.iterdir() if (d / "__init__.py").is_file())
    own = [n for n in _all(directory / "__init__.py") if n not in children | set(subpackages)]
    options = f"   :members: {', '.join(own)}\n" if own else "   :no-members:\n"
    level = "#" * (2 + dotted.count(".") - 1)
    out = [f"{level} {title}`{dotted}`\n", _block(dotted, options)]
    for stem in sorted(children):
        module = f"{dotted}.{stem}"
        note = f" (re-exported by `{re_exported[module]}`)" if module in re_exported else ""
        out += [f"{level}# `{module}`{note}\n", _block(module)]
    for sub in subpackages:
        out += _package(directory / sub, "", re_exported)
    return out


def page() -> str:
    sources = _facade_sources()
    re_exported = {m: f"cbs.{f}" for f, ms in sources.items() for m in ms}
    head = HEAD.format(
        facades=", ".join(f"`cbs.{f}`" for f in FACADES),
        sources="\n".join(f"- `cbs.{f}`: " + ", ".join(f"{{py:mod}}`{m}`" for m in ms)
                          for f, ms in sources.items()))
    body = []
    for pkg, title in LAYERS.items():
        body += _package(ROOT / "cbs" / pkg, f"{title}: ", re_exported)
    return head + "\n" + "\n".join(body)


if __name__ == "__main__":
    PAGE.write_text(page())
    print(f"wrote {PAGE}")
