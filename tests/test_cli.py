"""`--help` on every command: its description and its own flags, exit status 0
(`cbs.runtime.cli.exit_on_help`), before any flag is parsed or anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cbs.runtime import cli

COMMANDS = ("train", "sweep", "analyze", "branch", "ramps", "compare")
WRAPPERS = {"train": "main"}  # experiments/<name>.py of a command, where it differs
OWN_FLAGS = {"train": ("--config", "--workdir", "--coordinator_address"),
             "sweep": ("--config", "--sweep_dir", "--shard", "--[no]redefine"),
             "analyze": ("--sweep_dir", "--bootstrap", "--[no]partial"),
             "branch": ("--config", "--workdir", "--shard", "--[no]analyze_only"),
             "ramps": ("--config", "--sweep_dir", "--out_dir"),
             "compare": ("--out", "--bootstrap", "--[no]sizes")}


def _check_help(text: str, command: str) -> None:
    import ast
    import pathlib
    source = pathlib.Path(cli.__file__).parent.parent / "commands" / f"{command}.py"
    doc = ast.get_docstring(ast.parse(source.read_text()))
    assert doc.splitlines()[0] in text, "the command's description comes first"
    flags_part = text[text.index("\nflags:"):]
    for flag in OWN_FLAGS[command]:
        assert f"\n  {flag}: " in flags_part, f"cbs-{command} --help lacks {flag}"
    assert "--helpfull" in text and "--[no]verbose" in text
    assert "--xla_" not in text and "--jax_" not in text, "only the command's own flags"


def test_help_prints_the_description_and_own_flags_and_exits_0(capsys):
    from cbs.commands import analyze
    with pytest.raises(SystemExit) as exit_:
        cli.exit_on_help(analyze.main, ["cbs-analyze", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: cbs-analyze [flags]\n")
    _check_help(out, "analyze")
    cli.exit_on_help(analyze.main, ["cbs-analyze", "--sweep_dir=x"])  # no help: returns


def test_training_commands_list_the_multi_host_flags():
    """--distributed and --coordinator_address are defined in cbs.runtime.distributed; the
    commands that start a runtime adopt them, so their --help lists them (one process each:
    two commands' flags cannot share one)."""
    procs = {c: subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
             for c, cmd in _help_commands().items() if c in ("cbs-train", "cbs-sweep")}
    for name, proc in procs.items():
        text, _ = proc.communicate(timeout=300)
        for flag in ("--distributed", "--coordinator_address", "--num_processes", "--process_id"):
            assert f"\n  {flag}: " in text, f"{name} --help lacks {flag}"


def _help_commands() -> dict[str, list[str]]:
    """Both routes of every command: the console script's entry function (as the installed
    `cbs-<name>` calls it) and `python -m experiments.<name>` from the checkout."""
    out = {}
    for c in COMMANDS:
        script = (f"import sys; sys.argv = ['cbs-{c}', '--help']; "
                  f"from cbs.commands.{c} import run; run()")
        out[f"cbs-{c}"] = [sys.executable, "-c", script]
        out[f"experiments.{c}"] = [sys.executable, "-m",
                                   f"experiments.{WRAPPERS.get(c, c)}", "--help"]
    return out


@pytest.mark.slow
def test_help_of_every_command_on_both_routes():
    """Started together (each process imports the library), checked one by one."""
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name, cmd in _help_commands().items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} --help: status {proc.returncode}\n{err[-2000:]}"
        _check_help(out, name.split("-")[-1].split(".")[-1])


def test_help_and_hints_name_the_console_scripts_a_wheel_installs():
    """A wheel install has `cbs-train`, `cbs-sweep`, ... and no `experiments/` package: every
    command's --help (its module docstring) and every hint in the library name those (the line
    that says which module a console script is keeps naming it for a checkout)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent / "cbs"
    found = []
    for path in root.rglob("*.py"):
        if "configs" in path.parts:  # presets: their docstrings are the checkout's recipes
            continue
        # string literals continued on the next line ("... python -m "\n  "experiments...")
        text = re.sub(r'"\n\s*f?"', "", path.read_text())
        for i, line in enumerate(text.splitlines(), 1):
            named = re.search(r"(python -m |`)experiments\.(main|sweep|analyze|branch|ramps|"
                              r"compare|advise)\b", line)
            if named and "console script (and `python -m experiments." not in line:
                found.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    assert found == []
    import ast

    for name, script in (("sweep", "cbs-sweep"), ("train", "cbs-train")):  # their --help text
        doc = ast.get_docstring(ast.parse((root / "commands" / f"{name}.py").read_text()))
        assert f"{script} --config=" in doc


def test_the_library_defines_no_command_line_flags():
    """A researcher's own absl program imports cbs and defines its own flags (--verbose, say):
    only the commands define flags, so importing the library must not (a fresh process)."""
    script = ("import cbs, cbs.train, cbs.noise, cbs.fit, cbs.report, cbs.schedules, "
              "cbs.curvature\n"
              "from absl import flags\n"
              "ours = [n for m, fl in flags.FLAGS.flags_by_module_dict().items() "
              "if m.startswith('cbs') for n in (f.name for f in fl)]\n"
              "assert ours == [], ours\n"
              "flags.DEFINE_bool('verbose', False, 'the program\\'s own')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
