"""The documentation site builds with no warning (Sphinx + MyST, API pages from docstrings)."""

import ast
import importlib
import importlib.util
import inspect
import pathlib
import re

import _warm

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_docs_build_without_warnings(tmp_path):
    out = _warm.python(["-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                        str(ROOT / "docs"), str(tmp_path / "html")], timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ("value_grad_and_stats", "best_per_batch_size", "joint_bootstrap",
                 "fit_tradeoff", "llama3_schedule"):
        assert name in api, f"the API page lacks {name}"
    _api_page_is_complete(api)
    _docstrings_render_with_cross_references(api)


def _library_modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted((ROOT / "cbs").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _documented_modules() -> set[str]:
    text = (ROOT / "docs" / "api.md").read_text()
    return set(re.findall(r"^\.\. automodule:: (\S+)$", text, re.M))


def test_the_api_page_is_the_one_the_packages_write():
    """docs/api.md is what `python docs/api_page.py` writes: rerun it after a module moves."""
    spec = importlib.util.spec_from_file_location("api_page", ROOT / "docs" / "api_page.py")
    api_page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api_page)
    assert (ROOT / "docs" / "api.md").read_text() == api_page.page()


def test_the_api_page_documents_every_library_module():
    """Every module of the library (the façades aside, documented through the modules they
    re-export, and the command-line programs, documented by `--help`) has its section."""
    façades = {"cbs.noise", "cbs.curvature", "cbs.fit", "cbs.report", "cbs.schedules",
               "cbs.train"}
    wanted = {m for m in _library_modules() if m != "cbs" and m not in façades
              and not m.startswith("cbs.commands")}
    assert sorted(wanted - _documented_modules()) == []


def _api_page_is_complete(api: str) -> None:
    """Every name in the `__all__` of every documented module has an entry: under its module
    (`id="cbs.stats.noise.exact"`), or for a package's gathered names under its submodule."""
    missing, modules = [], _library_modules()
    for module in sorted(_documented_modules()):
        mod = importlib.import_module(module)
        is_package = hasattr(mod, "__path__")
        for name in getattr(mod, "__all__", ()):
            if f"{module}.{name}" in modules:
                found = f'id="module-{module}.{name}"' in api
            elif is_package:
                found = re.search(rf'id="{re.escape(module)}(\.\w+)?\.{name}"', api)
            else:
                found = f'id="{module}.{name}"' in api
            if not found:
                missing.append(f"{module}.{name}")
    assert missing == [], f"the API page lacks {missing}"
    for name in ("cbs.stats.smoothing.NoiseScaleEMA", "cbs.stats.smoothing.two_batch",
                 "cbs.stats.loss_checks.allow_randomness", "cbs.stats.ghost.coverage"):
        assert f'id="{name}"' in api


def _docstrings_render_with_cross_references(api: str) -> None:
    """Docstrings are text with links, not literal blocks: a backquoted `cbs.x.y` links to
    where it is defined, through a façade too (`cbs.train.run` -> cbs.engine.trainer.run)."""
    links = re.findall(r'<a class="reference internal" href="#(cbs\.[\w.]+)"', api)
    assert len(links) > 200, len(links)
    assert "cbs.engine.loop.Loop" in links and "cbs.engine.trainer.run" in links
    assert 'class="line-block"' in api
    first = "Training runs from a config: set-up, the loop, evaluation, checkpoints"
    at = api.index(first)
    assert api.rfind("<pre>", 0, at) < api.rfind('<div class="line">', 0, at), "a literal block"


# `--config.a.b=value` on a command line, and `config.a.b = value` in prose or code.
_SETS_FIELD = re.compile(r"(?<![\w.])(--)?config((?:\.[a-z_][a-z0-9_]*)+)\s?=")
_OPTIONAL = re.compile(r"^\s*# c\.([a-z_.]+) \(optional", re.M)


def _guide_settings() -> list[tuple[str, str]]:
    """(where, dotted field) for every config field the guides, README, notebooks and the
    config files' docstrings set."""
    paths = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md",
             *sorted((ROOT / "notebooks").glob("*.ipynb")),
             *sorted((ROOT / "experiments" / "configs").glob("*.py"))]
    out = []
    for path in paths:
        text = path.read_text()
        if path.suffix == ".py":
            text = ast.get_docstring(ast.parse(text)) or ""
        for m in _SETS_FIELD.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{path.relative_to(ROOT)}:{line}", m.group(2)[1:]))
    return out


def _known_configs() -> list:
    """The default config and every shipped config file's `get_config()`."""
    from cbs.engine import config as config_lib
    out = [config_lib.default_config()]
    for path in sorted((ROOT / "experiments" / "configs").glob("*.py")):
        module = importlib.import_module(f"experiments.configs.{path.stem}")
        if hasattr(module, "get_config"):
            out.append(module.get_config())
    return out


def _has_field(config, dotted: str) -> bool:
    node = config
    for part in dotted.split("."):
        if not hasattr(node, "keys") or part not in node.keys():
            return False
        node = node[part]
    return True


def test_every_config_field_a_guide_sets_exists():
    """A `--config.x.y=` override (or `config.x.y = ...`) shown in the documentation names a
    field of the default config or of a shipped config file; a documented optional field
    (absent by default, `# c.x.y (optional ...)` in `default_config`) may be set in a config
    file only, never as a `--config` flag on the default config."""
    from cbs.engine import config as config_lib
    optional = set(_OPTIONAL.findall(inspect.getsource(config_lib.default_config)))
    configs = _known_configs()
    settings = _guide_settings()
    assert len(settings) > 20, "the scan finds the documented overrides"
    missing = [f"{where}: config.{field}" for where, field in settings
               if field not in optional and not any(_has_field(c, field) for c in configs)]
    assert missing == [], "fields that no config has:\n" + "\n".join(missing)
    flags = [where for where, field in settings if field in optional and
             f"--config.{field}=" in (ROOT / where.split(":")[0]).read_text()]
    assert flags == [], f"an optional field as a flag: {flags}"
    assert not _has_field(configs[0], "train.no_such_field")


def test_one_spelling_of_analyze():
    """"analyze" as the command `cbs-analyze` spells it, in code, docs and notebooks alike."""
    other = re.compile(r"\banaly" + r"s(e|es|ed|ing|e_\w+)\b")  # not "analyses", the noun
    paths = [p for pattern in ("cbs/**/*.py", "experiments/**/*.py", "tests/*.py",
                               "benchmarks/**/*.py", "docs/**/*.md", "notebooks/*.ipynb")
             for p in ROOT.glob(pattern)] + [ROOT / "README.md"]
    found = [f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
             for p in paths for text in [p.read_text()] for m in other.finditer(text)
             if m.group(1) != "es"]
    assert found == []


def test_ci_runs_exactly_the_readme_test_command():
    """.ci/run's last line is README's second command, which runs the default suite and the
    newest-releases job (tests/test_newest.py)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    assert blocks[1].startswith('pip install -e ".[test]"') and "-m newest" in blocks[1]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == blocks[1]
