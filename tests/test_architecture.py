"""The import rule of docs/design.md: layers import only lower layers, no cycles; and the
one public surface: `__all__` in every module, façades that re-export it, one public path per
name, no re-exports between library modules, package docstrings that list their modules.

Every module under cbs/ is parsed (not imported); imports inside functions count too, since
a deferred import is still a dependency and a deferred cycle still a cycle.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "cbs"
ALIASES = {"noise", "curvature", "fit", "schedules", "train", "report"}
ALLOWED = {  # package -> packages it may import (besides itself)
    "stats": set(),
    "data": {"results"},
    "results": set(),
    "models": {"stats"},
    "analysis": {"results"},
    "runtime": {"stats", "data", "results", "models"},
    "engine": {"stats", "data", "results", "models", "runtime"},
    "sweeps": {"stats", "data", "results", "models", "analysis", "runtime", "engine"},
    "configs": {"stats", "data", "results", "models", "analysis", "runtime", "engine",
                "sweeps"},
    "commands": {"stats", "data", "results", "models", "analysis", "runtime", "engine",
                 "sweeps", "configs"},
}
PENDING: set[str] = set()  # modules exempt from the `__all__` and re-export checks: none


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
    """A façade imports whole public APIs: its `__all__` is the union of the `__all__` of the
    modules it imports from, every name the very object defined there."""
    modules = _modules()
    packages = {m.split(".")[1] for m in modules if m.count(".") >= 1}
    top_level = {m.split(".")[1] for m in modules if m.count(".") == 1
                 and not (ROOT / m.split(".")[1]).is_dir()}
    assert top_level == ALIASES, "a new top-level module: put it in a layer package"
    assert packages - ALIASES == set(ALLOWED)
    for name in ALIASES:
        tree = ast.parse((ROOT / f"{name}.py").read_text())
        assert "sys.modules" not in ast.unparse(tree)
        facade = importlib.import_module(f"cbs.{name}")
        sources = {n.module: [a.name for a in n.names] for n in tree.body
                   if isinstance(n, ast.ImportFrom)}
        expected = set()
        for module, imported in sources.items():
            real = importlib.import_module(module)
            public = set(_declared_all(modules[module]) or imported)  # PENDING: as imported
            assert set(imported) == public, f"cbs.{name} must import exactly {module}.__all__"
            expected |= public
            for n in public:
                assert getattr(facade, n) is getattr(real, n)
        assert sorted(facade.__all__) == sorted(expected), f"cbs/{name}.py: __all__"


def _declared_all(path: pathlib.Path) -> list[str] | None:
    """The literal `__all__` of a module file, or None when it has none."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def _defined(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level by def, class or assignment (not by import)."""
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def _own(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Per module, the names another module may take from it: those it defines, its
    submodules, and for a package the names of its submodules that its `__all__` lists."""
    out = {}
    for m, path in modules.items():
        names = _defined(ast.parse(path.read_text()))
        names |= {s.rsplit(".", 1)[1] for s in modules if "." in s and s.rsplit(".", 1)[0] == m}
        if path.name == "__init__.py":
            names |= set(_declared_all(path) or [])
        out[m] = names
    return out


def _is_facade(module: str) -> bool:
    return module.count(".") == 1 and module.split(".")[1] in ALIASES


def test_every_module_declares_all_and_all_names_its_own_definitions():
    """`__all__` is the one definition of public: every module has one (a literal list), and
    a module lists only names it defines (a package may list a name one of its submodules
    defines, which that submodule then leaves out of its own: one public path per name)."""
    modules = _modules()
    missing, foreign = [], []
    for m, path in modules.items():
        declared = _declared_all(path)
        if m in PENDING or _is_facade(m):
            continue
        if declared is None:
            missing.append(m)
            continue
        own = _defined(ast.parse(path.read_text()))
        if path.name == "__init__.py":  # a package may list names its submodules define
            subs = {k: v for k, v in modules.items() if "." in k and k.rsplit(".", 1)[0] == m}
            own |= {k.rsplit(".", 1)[1] for k in subs}
            own |= {n for v in subs.values() for n in _defined(ast.parse(v.read_text()))}
        foreign += [f"{m}.__all__ names {n}, defined elsewhere" for n in declared if n not in own]
    assert missing == [], f"modules without __all__: {missing}"
    assert foreign == [], "\n".join(foreign)


def _module_aliases(tree: ast.Module, modules: set[str]) -> dict[str, str]:
    """Local names bound to cbs modules by `from cbs.x import y` or `import cbs.x as y`."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if f"{node.module}.{a.name}" in modules:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            out |= {a.asname: a.name for a in node.names if a.asname and a.name in modules}
    return out


def _rebound(tree: ast.Module) -> set[str]:
    """Names bound other than by import (arguments, assignments, loop targets): a module alias
    shadowed by a local is not followed."""
    out = {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
           for a in n.args + n.kwonlyargs + n.posonlyargs}
    return out | {n.id for n in ast.walk(tree)
                  if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _borrowed(path: pathlib.Path, modules: set[str], own: dict[str, set[str]]) -> list[str]:
    """Places where `path` takes a name from a cbs module that does not define it."""
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in own and node.level == 0:
            bad += [f"{path.name}:{node.lineno} imports {a.name} from {node.module}"
                    for a in node.names if a.name not in own[node.module]]
    aliases = _module_aliases(tree, modules)
    for name in _rebound(tree):
        aliases.pop(name, None)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr not in own[aliases[node.value.id]]):
            bad.append(f"{path.name}:{node.lineno} reads {node.attr} through "
                       f"{aliases[node.value.id]}")
    return bad


def test_library_modules_import_names_from_where_they_are_defined():
    """No re-exports between library modules: a name comes from the module that defines it
    (or a package whose `__all__` lists it), never through another module that imported it."""
    modules = _modules()
    own = _own(modules)
    bad = []
    for m, path in modules.items():
        if m not in PENDING and not _is_facade(m):
            bad += _borrowed(path, set(modules), own)
    assert bad == [], "\n".join(bad)


def test_the_re_export_check_can_fail(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("from cbs.engine import trainer\nfrom cbs.engine.trainer import config_hash\n"
                 "x = trainer.config_hash\n")
    modules = _modules()
    bad = _borrowed(f, set(modules), _own(modules))
    assert len(bad) == 2, bad


def test_every_package_docstring_lists_its_modules():
    """A package's docstring names each of its modules and subpackages (as `name` in
    backquotes)."""
    bad = []
    for init in sorted(ROOT.glob("*/**/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        members = [m.stem for m in init.parent.glob("*.py") if m.name != "__init__.py"]
        members += [d.name for d in init.parent.iterdir() if (d / "__init__.py").is_file()]
        for name in sorted(members):
            if f"`{name}`" not in doc:
                bad.append(f"{_module_name(init)} does not list `{name}`")
    assert bad == [], "\n".join(bad)


ANALYSIS_ORDER = ["fits", "reports", "advice", "studies"]  # each imports only those before it


def test_analysis_subpackages_import_only_earlier_ones():
    bad = []
    for module, imported in _graph().items():
        parts = module.split(".")
        if parts[1:2] != ["analysis"] or len(parts) < 4:
            continue
        rank = ANALYSIS_ORDER.index(parts[2])
        for target in imported:
            tparts = target.split(".")
            if tparts[1:2] == ["analysis"] and len(tparts) >= 3 and tparts[2] in ANALYSIS_ORDER:
                if ANALYSIS_ORDER.index(tparts[2]) > rank:
                    bad.append(f"{module} imports {target}")
    assert bad == [], "\n".join(bad)


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


def test_config_errors_in_the_engine_and_above_are_config_errors():
    """One validation style: where `ConfigError` can be imported (the engine and above), a
    config field's error is a `ConfigError` whose message starts with the dotted field
    (`config.sweep.batch_sizes: ...`), never a bare ValueError."""
    bad = []
    for module, path in _modules().items():
        if _package(module) not in {"engine", "sweeps", "commands"} or module in PENDING:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and getattr(node.exc.func, "id", None) == "ValueError" and node.exc.args
                    and ast.unparse(node.exc.args[0]).lstrip("f").startswith(("'config.",
                                                                              '"config.'))):
                bad.append(f"{module}:{node.lineno}")
    assert bad == [], f"config errors raised as ValueError: {bad}"


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """A module's top-level statements, those under a top-level `if` or `try` included."""
    out: list[ast.stmt] = []
    for node in tree.body:
        out.append(node)
        if isinstance(node, (ast.If, ast.Try)):
            out += _top_level(ast.Module(body=node.body + node.orelse + [
                s for h in getattr(node, "handlers", ()) for s in h.body], type_ignores=[]))
    return out


def _origin(module: str, name: str, modules: dict[str, pathlib.Path],
            seen: frozenset = frozenset()) -> tuple[str, str] | None:
    """Where `module.name` is defined, (module, name), following `from x import name` and
    plain aliases (`name = other.attr`, `other` a cbs module); None for a submodule."""
    if f"{module}.{name}" in modules or module not in modules or (module, name) in seen:
        return None if f"{module}.{name}" in modules else (module, name)
    seen = seen | {(module, name)}
    tree = ast.parse(modules[module].read_text())
    aliases = _module_aliases(tree, set(modules))
    found = (module, name)
    for node in _top_level(tree):
        if isinstance(node, ast.ImportFrom) and node.module in modules and node.level == 0:
            for a in node.names:
                if (a.asname or a.name) == name:
                    found = _origin(node.module, a.name, modules, seen) or found
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name) and node.targets[0].id == name
              and isinstance(node.value, ast.Attribute)
              and isinstance(node.value.value, ast.Name) and node.value.value.id in aliases):
            found = _origin(aliases[node.value.value.id], node.value.attr, modules, seen) or found
    return found


def _public_paths(modules: dict[str, pathlib.Path]) -> dict[tuple[str, str], list[str]]:
    """Per definition (module, name), the public paths that reach it: `module.name` for every
    name in the `__all__` of a module other than a façade (submodules aside)."""
    out: dict[tuple[str, str], list[str]] = {}
    for m, path in modules.items():
        if _is_facade(m):
            continue
        for name in _declared_all(path) or []:
            if (origin := _origin(m, name, modules)) is not None:
                out.setdefault(origin, []).append(f"{m}.{name}")
    return out


def test_every_public_name_has_one_public_path():
    """One public path per name: no name is in the `__all__` of two modules (a package that
    gathers its submodules' names while the submodule lists them too, an alias that a module
    lists as its own). The façades (`cbs.noise`, ...) re-export by design and are not
    counted. A package keeps a name only where the guides import it from the package (the
    submodule then leaves it out of its own `__all__`)."""
    doubles = sorted(paths for paths in _public_paths(_modules()).values() if len(paths) > 1)
    assert doubles == [], f"{len(doubles)} names with two public paths: {doubles}"


def test_the_public_path_check_can_fail(tmp_path):
    pkg = tmp_path / "cbs" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from cbs.pkg import sub\nfrom cbs.pkg.sub import f\n"
                                     "g = sub.g\n__all__ = ['f', 'g', 'sub']\n")
    (pkg / "sub.py").write_text("def f(): pass\ndef g(): pass\n__all__ = ['f', 'g']\n")
    modules = {"cbs.pkg": pkg / "__init__.py", "cbs.pkg.sub": pkg / "sub.py"}
    assert _public_paths(modules) == {("cbs.pkg.sub", "f"): ["cbs.pkg.f", "cbs.pkg.sub.f"],
                                      ("cbs.pkg.sub", "g"): ["cbs.pkg.g", "cbs.pkg.sub.g"]}


# ---------------------------------------------------------------- the core's size and reads

NOISE_SECTION_READER = "cbs.engine.noise_spec"  # the one module that reads config.noise


def _noise_section_reads(modules: dict[str, pathlib.Path]) -> dict[str, list[int]]:
    """Per module, the lines that read a field of a run config's noise section
    (`<x>.noise.<field>` or `<x>.noise.get(...)` loaded, `<x>["noise"]`): writes (a preset
    or a launcher setting a field) are not reads. The presets (`cbs.configs`) only write."""
    out: dict[str, list[int]] = {}
    for m, path in modules.items():
        if m == NOISE_SECTION_READER or m.startswith("cbs.configs"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                    and isinstance(node.value, ast.Attribute) and (
                        (node.value.attr == "noise" and _is_config(node.value.value))
                        or node.value.attr in STUDY_NOISE_SECTIONS
                        or (node.value.attr == "noise" and isinstance(node.value.value, (
                            ast.Attribute, ast.Name)) and _name(node.value.value) == "branch"))):
                out.setdefault(m, []).append(node.lineno)
    return out


CONFIG_NAMES = {"config", "c", "cfg", "run_config", "base", "single", "raw"}
# A study's own noise fields (`config.sweep.reference_noise`; `config.branch.noise` below).
STUDY_NOISE_SECTIONS = {"reference_noise"}


def _name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _is_config(node: ast.expr) -> bool:
    """A run config by name: `config`, `c`, ..., or `<x>.config`."""
    return (isinstance(node, ast.Name) and node.id in CONFIG_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr == "config")


def test_config_noise_is_read_in_one_place():
    """Only `NoiseSpec.from_config` reads `config.noise` and only `NoiseSpec.of` a study's
    noise section (`sweep.reference_noise`, `branch.noise`); everything else takes the spec
    (`RunParts.noise_spec`, `NoiseSpec.of(config[, study])`)."""
    assert _noise_section_reads(_modules()) == {}


def test_the_noise_read_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(config):\n    return config.noise.every\n"
                   "def g(config, branch):\n    return (config.sweep.reference_noise.deviations,"
                   "\n            config.branch.noise.deviations, branch.noise.chunk_size)\n")
    assert _noise_section_reads({"cbs.engine.bad": bad}) == {"cbs.engine.bad": [2, 4, 5, 5]}


def _public_members(cls: type) -> set[str]:
    """The public names of a class: its dataclass fields or protocol attributes, and the
    methods and properties it defines (dunders aside)."""
    names = set(getattr(cls, "__dataclass_fields__", {})) | set(
        getattr(cls, "__annotations__", {}))
    names |= {n for n in vars(cls) if not n.startswith("_")}
    return {n for n in names if not n.startswith("_")}


def test_the_step_and_the_driver_are_small():
    """TrainStep: at most 8 public members, none of them the measurement's; the Driver
    protocol: at most 6 members; one step reads in at most three engine modules."""
    from cbs.engine.driver import Driver
    from cbs.engine.step import TrainStep

    step_members = _public_members(TrainStep)
    assert len(step_members) <= 8, sorted(step_members)
    assert not any("measure" in n for n in step_members), sorted(step_members)
    driver_members = _public_members(Driver)
    assert len(driver_members) <= 6, sorted(driver_members)
    graph = _graph()
    engine = {m for m in graph["cbs.engine.step"] if m.startswith("cbs.engine")}
    assert len(engine | {"cbs.engine.step"}) <= 3, sorted(engine)
