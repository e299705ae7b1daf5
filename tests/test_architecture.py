"""The import rule of docs/design.md: layers import only lower layers, no cycles.

Every module under cbs/ is parsed (not imported); imports inside functions count too, since
a deferred import is still a dependency and a deferred cycle still a cycle.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "cbs"
ALIASES = {"noise", "curvature", "fit", "schedules", "train", "report"}
ALLOWED = {  # package -> packages it may import (besides itself)
    "stats": set(),
    "data": set(),
    "results": set(),
    "models": {"stats"},
    "analysis": {"results"},
    "engine": {"stats", "data", "results", "models"},
    "sweeps": {"stats", "data", "results", "models", "analysis", "engine"},
    "configs": {"stats", "data", "results", "models", "analysis", "engine", "sweeps"},
    "commands": {"stats", "data", "results", "models", "analysis", "engine", "sweeps", "configs"},
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """The cbs modules that `path` imports (a name imported from a package counts as the
    submodule when there is one, else as the package)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "cbs"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "cbs":
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return out


def _package(module: str) -> str | None:
    """"stats" for cbs.stats.noise; None for cbs itself and the top-level aliases."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, set(modules)) for m, p in modules.items()}


def test_every_package_is_known_and_every_alias_is_a_plain_facade():
    modules = _modules()
    packages = {m.split(".")[1] for m in modules if m.count(".") >= 1}
    top_level = {m.split(".")[1] for m in modules if m.count(".") == 1
                 and not (ROOT / m.split(".")[1]).is_dir()}
    assert top_level == ALIASES, "a new top-level module: put it in a layer package"
    assert packages - ALIASES == set(ALLOWED)
    for name in ALIASES:  # a façade re-exports the real module's whole public API
        source = (ROOT / f"{name}.py").read_text()
        assert "sys.modules" not in source
        facade = importlib.import_module(f"cbs.{name}")
        for module in _facade_sources(source):
            real = importlib.import_module(module)
            missing = sorted(set(_public_names(real)) - set(vars(facade)))
            assert not missing, f"cbs.{name} lacks {missing}: add them to cbs/{name}.py"
            for n in _public_names(real):
                assert getattr(facade, n) is getattr(real, n)


def _facade_sources(source: str) -> list[str]:
    """The modules a façade file re-exports whole: its `from cbs.X.Y import (...)` with the most
    names and any other with more than two (a façade may add a name or two from a sibling
    module without taking on that module's whole API)."""
    nodes = [n for n in ast.parse(source).body if isinstance(n, ast.ImportFrom)]
    top = max(nodes, key=lambda n: len(n.names))
    return [n.module for n in nodes if n is top or len(n.names) > 2]


def _public_names(module) -> list[str]:
    """Names a user may import from a module: its functions, classes and constants, and
    those it takes from other cbs modules (not third-party names such as np or Any)."""
    out = []
    for n, v in vars(module).items():
        if n.startswith("_") or inspect.ismodule(v):
            continue
        owner = getattr(v, "__module__", None)
        if (owner or "").startswith("cbs") or (owner is None and n.isupper()):
            out.append(n)
    return out


def test_layers_import_only_lower_layers():
    bad = []
    for module, imported in _graph().items():
        pkg = _package(module)
        if pkg is None:
            continue
        for target in imported:
            tpkg = _package(target)
            if target.split(".")[1:2] and target.split(".")[1] in ALIASES and tpkg is None:
                bad.append(f"{module} imports the public alias {target}")
            elif tpkg is not None and tpkg != pkg and tpkg not in ALLOWED[pkg]:
                bad.append(f"{module} ({pkg}) imports {target} ({tpkg})")
    assert bad == [], "\n".join(bad)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the import graph as a path that returns to its start, or None. A package's
    __init__ is a node like any other: a submodule importing names from its own package while
    that __init__ imports the submodule is a cycle too."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if t not in graph or t == m:
                continue
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_cycle_through_a_package_init_is_found():
    graph = {"cbs.stats": {"cbs.stats.noise"}, "cbs.stats.noise": {"cbs.stats", "cbs.stats.trees"},
             "cbs.stats.trees": set()}
    assert _find_cycle(graph) == ["cbs.stats", "cbs.stats.noise", "cbs.stats"]
    del graph["cbs.stats"]
    assert _find_cycle(graph) is None


def test_the_checker_finds_a_violation(tmp_path):
    """The rule can fail: an upward import is caught."""
    f = tmp_path / "bad.py"
    f.write_text("from cbs.engine import trainer\nimport cbs.noise\n")
    found = _imports(f, {"cbs.engine.trainer", "cbs.noise"})
    assert found == {"cbs.engine.trainer", "cbs.noise"}
    assert "engine" not in ALLOWED["stats"] and "sweeps" not in ALLOWED["engine"]
