"""The experiment presets that ship with the package, selectable by name on every command:

    cbs-sweep --config=digits_sweep:tiny --sweep_dir=/tmp/t      # or --config=cbs:digits_sweep:tiny

Each preset is a module whose `get_config(arg)` returns a `cbs.engine.config` ConfigDict (`arg`:
the text after the name's `:`); `base` holds their shared helpers. A checkout also reaches each
by path, `--config=experiments/configs/<name>.py[:arg]`. The presets: single runs
`digits_mlp`, `mnist1d_mlp`, `cnn`, `lm_shakespeare`, `shakespeare_transformer`; sweeps
`digits_sweep` (the main job), `digits_sgd_sweep`, `mnist1d_sweep`, `linreg_sweep`,
`cnn_sweep`, `shakespeare_sweep`, `shakespeare_kaplan`, `teacher_student_sweep`,
`heldout_sweep` (three held-out tasks); ramps `digits_ramps` (also the single ramps
`:llama3`, `:deepseek`, `:adaptive`), `digits_payoff`, `shakespeare_payoff`; branch studies
`digits_branch`, `shakespeare_branch`. `resolve` turns a `--config` value into the flag
library's path[:arg] without importing a preset.
"""

from __future__ import annotations

import ast
import pathlib

__all__ = ["PREFIX", "names", "path", "resolve"]

PREFIX = "cbs:"  # `--config=cbs:<name>[:arg]` names a packaged preset explicitly
_HERE = pathlib.Path(__file__).resolve().parent


def names() -> list[str]:
    """The packaged presets' names, sorted (modules here with a top-level `get_config`)."""
    return sorted(f.stem for f in _HERE.glob("*.py") if not f.stem.startswith("_") and any(
        isinstance(n, ast.FunctionDef) and n.name == "get_config"
        for n in ast.parse(f.read_text(encoding="utf-8"), str(f)).body))


def path(name: str) -> str:
    """The file of the packaged preset `name`; ValueError naming the presets if there is none."""
    if not name.isidentifier() or name not in names():
        raise ValueError(f"--config={name}: no such config file or packaged preset; presets: "
                         f"{', '.join(names())} (or give a config file's path)")
    return str(_HERE / f"{name}.py")


def resolve(value: str) -> str:
    """A `--config` value as the flag library's `path[:arg]`: `cbs:<name>[:arg]`, or a bare
    `<name>[:arg]` that is no path (no `/`, no `.py`, no such file), becomes the preset's path."""
    explicit = value.startswith(PREFIX)
    rest = value[len(PREFIX):] if explicit else value
    name, sep, arg = rest.partition(":")
    if not explicit and ("/" in name or "\\" in name or name.endswith(".py")
                         or pathlib.Path(name).is_file()):
        return value
    return path(name) + sep + arg
