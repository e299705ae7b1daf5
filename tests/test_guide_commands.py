"""Every command shown in the guides (docs/guides/*.md, docs/scaling.md) works.

Two kinds of command, by how the page shows them:

- a quick command: a fenced block right after `<!-- quick: runs as a test -->` (or `<!-- quick:
  runs as a slow test -->`, for blocks that train for more than a few seconds on a CPU) runs
  here, each line in order from the repository root, with `/tmp/cbs/` standing for a fresh
  temporary directory, on the simulated plain install of tests/_plain_install.py (no extra
  installed: none of these commands names one); it must exit with status 0. Each guide that
  shows commands has one.
- every other command line (a console script, `cbs-sweep ...`, or `python -m experiments.X
  ...` or `python -m benchmarks.X ...` in a fenced or indented block or in backquotes: full
  studies, multi-host launches), and every command in a preset's docstring (cbs/configs), is
  checked without running: the module exists, every flag
  is one it defines, the config resolves and loads with its argument, each
  `--config.a.b=...` names a field of it, the config's sweep, ramps and branch sections (and
  its run config) validate, and the committed study directories it names exist.

The guides and README show the commands as a wheel installs them (`cbs-train`, `cbs-sweep`,
..., presets by name); `python -m experiments.X` of a command that has a console script
appears at most once a page, as the note that names the checkout's form.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import shlex
import tomllib
from typing import Any

import _plain_install
import pytest

from cbs import configs, data, models
from cbs.engine import config as config_lib
from cbs.sweeps import branch_config, grid, ramps

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs" / "guides").glob("*.md")) + [ROOT / "docs" / "scaling.md"]
QUICK, SLOW = "<!-- quick: runs as a test -->", "<!-- quick: runs as a slow test -->"
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
MARKED = re.compile(r"^(" + re.escape(QUICK) + "|" + re.escape(SLOW) + r")\n```[a-z]*\n(.*?)^```",
                    re.S | re.M)
# console script -> the module it runs (pyproject.toml) and its checkout twin in experiments/
SCRIPTS = {name: target.split(":")[0] for name, target in tomllib.loads(
    (ROOT / "pyproject.toml").read_text())["project"]["scripts"].items()}
TWINS = {name: "experiments." + ("main" if name == "cbs-train" else name[len("cbs-"):])
         for name in SCRIPTS}
COMMAND = re.compile(r"(?:python -m ((?:experiments|benchmarks)\.\w+)|(?<![\w/.-])("
                     + "|".join(map(re.escape, SCRIPTS)) + r")(?![\w-]))([^`\"\n]*)")
TMP = "/tmp/cbs/"
ABSL = {"verbosity", "v", "logtostderr", "alsologtostderr", "help", "helpfull", "verbose",
        "distributed", "coordinator_address", "num_processes", "process_id"}


def _joined(text: str) -> str:
    """Lines continued with a backslash joined; comments after a command dropped."""
    text = re.sub(r"\\\n\s*", " ", text)
    return "\n".join(re.sub(r"\s+#.*$", "", line) for line in text.splitlines())


def _blocks(text: str) -> list[str]:
    """Fenced blocks and 4-space indented blocks (outside fences), as text."""
    out = FENCE.findall(text)
    outside = FENCE.sub("", text)
    for block in re.findall(r"(?:^(?: {4}|\t).*\n?)+", outside, re.M):
        out.append(re.sub(r"^(?: {4}|\t)", "", block, flags=re.M))
    return out


def _commands(text: str) -> list[tuple[str, list[str]]]:
    """(module, arguments) of each command line on a page: in its blocks and in backquotes."""
    found = []
    for block in _blocks(text):
        for line in _joined(block).splitlines():
            found += COMMAND.findall(line)
    for span in re.findall(r"`([^`]+)`", _joined(FENCE.sub("", text))):
        found += COMMAND.findall(span)
    return [(module or TWINS[script], shlex.split(args)) for module, script, args in found]


def _quick_blocks() -> list[Any]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for i, (mark, block) in enumerate(MARKED.findall(text)):
            lines = [line for line in _joined(block).splitlines() if line.strip()]
            marks = [pytest.mark.slow] if mark == SLOW else []
            out.append(pytest.param(lines, id=f"{page.stem}-{i}", marks=marks))
        assert text.count(QUICK) + text.count(SLOW) == len(MARKED.findall(text)), (
            f"{page}: a quick marker without a fenced block right after it")
    return out


def test_every_guide_that_shows_commands_has_a_quick_block():
    quick = {p.id.rsplit("-", 1)[0] for p in _quick_blocks()}
    shown = {p.stem for p in PAGES if _commands(p.read_text())}
    assert shown - quick == set()


@pytest.mark.parametrize("lines", _quick_blocks())
def test_quick_commands_run(lines, tmp_path):
    for line in lines:
        args = [a.replace(TMP, f"{tmp_path}/") for a in shlex.split(line)]
        if args[0] in SCRIPTS:  # the console script: the module it runs
            args = ["python", "-m", SCRIPTS[args[0]], *args[1:]]
        assert args[:2] == ["python", "-m"], f"a quick command runs python -m: {line}"
        proc = _plain_install.run(args[2], *args[3:], timeout=900)
        assert proc.returncode == 0, f"{line}\n{proc.stderr[-3000:]}"


# ---------------------------------------------------------------------------- the others

def _module_file(module: str) -> pathlib.Path:
    path = ROOT / (module.replace(".", "/") + ".py")
    assert path.is_file(), f"no module {module}"
    command = re.search(r"^from cbs\.commands\.(\w+) import", path.read_text(), re.M)
    return ROOT / "cbs" / "commands" / f"{command[1]}.py" if command else path


def _defined_flags(path: pathlib.Path) -> tuple[set[str], set[str], bool]:
    """(flags, bool flags, argparse?) that the module defines."""
    names, bools, argparse = set(), set(), False
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else ""
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        if func.startswith("DEFINE_"):
            names.add(first.value)
            if func in ("DEFINE_bool", "DEFINE_boolean"):
                bools.add(first.value)
        elif func == "add_argument":
            argparse = True
            names.update(a.value.lstrip("-") for a in node.args if isinstance(a, ast.Constant))
    return names, bools, argparse


def _load_config(value: str) -> tuple[Any, str]:
    path, _, arg = configs.resolve(value).partition(":")
    spec = importlib.util.spec_from_file_location(f"_guide_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg), path


def _has_field(config: Any, dotted: str) -> bool:
    node = config
    for part in dotted.split("."):
        if not hasattr(node, "keys") or part not in node:
            return False
        node = node[part]
    return True


def _validate(module: str, config: Any) -> None:
    if "sweep" in config and module in ("experiments.sweep", "experiments.ramps"):
        grid.validate_sweep(config.sweep)
    if module == "experiments.ramps":
        ramps.validate_ramps(config, replicas=1)
    if module == "experiments.branch":
        branch_config.validate_branch_config(config)
    if module == "experiments.main":
        config_lib.validate(config, data_replicas=1, model_names=models.model_names(),
                            dataset_names=data.known_datasets())


def _preset_docstrings() -> dict[str, str]:
    """{preset: its module's docstring} of the presets that ship in cbs/configs."""
    return {f.stem: ast.get_docstring(ast.parse(f.read_text())) or ""
            for f in sorted((ROOT / "cbs" / "configs").glob("*.py"))}


def _shown_commands() -> list[Any]:
    """The commands the guides show, then those of the presets' docstrings."""
    out, seen = [], set()
    texts = [(page.stem, page.read_text()) for page in PAGES] + [
        (f"preset_{name}", doc) for name, doc in _preset_docstrings().items()]
    for where, text in texts:
        for module, args in _commands(text):
            key = (module, tuple(args))
            if key not in seen:
                seen.add(key)
                out.append(pytest.param(module, args, id=f"{where}:{module}:{len(out)}"))
    return out


def test_the_guides_show_commands():
    assert len(_shown_commands()) > 20


def test_the_guides_and_readme_show_the_console_scripts():
    """A wheel has `cbs-sweep` and no experiments/ package: `python -m experiments.X` of a
    command with a console script appears at most once a page, in a note naming the
    checkout (experiments/ tools without one, such as `experiments.anchor`, stay)."""
    twins = "|".join(t.split(".")[1] for t in TWINS.values())
    for page in [*sorted((ROOT / "docs" / "guides").glob("*.md")), ROOT / "README.md"]:
        text = " ".join(page.read_text().split())
        found = [m.start() for m in re.finditer(rf"python -m experiments\.({twins})\b", text)]
        assert len(found) <= 1, f"{page.name}: {len(found)} checkout forms; show cbs-* instead"
        for at in found:
            assert "checkout" in text[max(0, at - 300):at + 300], (
                f"{page.name}: `python -m experiments...` outside the note naming the checkout")


def test_the_presets_show_the_console_scripts():
    """The presets ship in the wheel, which has no experiments/ package: their docstrings show
    `cbs-train --config=<preset>`, not `python -m experiments.main --config=experiments/...`."""
    twins = "|".join(t.split(".")[1] for t in TWINS.values())
    docs = _preset_docstrings()
    assert sum(bool(_commands(doc)) for doc in docs.values()) > 15
    for name, doc in docs.items():
        assert not re.search(rf"python -m experiments\.({twins})\b", doc), name
        assert name not in configs.names() or "--config=experiments/configs" not in doc, name


@pytest.mark.parametrize("module,args", _shown_commands())
def test_a_shown_command_names_flags_configs_and_studies_that_exist(module, args, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    names, bools, argparse = _defined_flags(_module_file(module))
    config, overrides = None, []
    for arg in args:
        if arg in ("...", "\\") or "$" in arg:
            continue  # a placeholder the reader fills in
        if not arg.startswith("--"):
            if arg.startswith("results/") and not argparse:  # a committed study it reads
                assert (ROOT / arg).is_dir(), f"{module}: no study {arg}"
            continue
        name, _, value = arg[2:].partition("=")
        if name.startswith("config."):
            overrides.append(name[len("config."):])
        elif name == "config" and "..." not in value:
            config, _ = _load_config(value)
        elif not argparse and name.startswith("no") and name[2:] in bools:
            continue
        else:
            assert name in names | (set() if argparse else ABSL), f"{module}: no flag --{name}"
    for field in overrides:
        assert config is not None and _has_field(config, field), f"no field config.{field}"
    if config is not None:
        _validate(module, config)
