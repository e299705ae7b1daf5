"""Config field checks shared by the engine's components (docs/design.md, "Config
validation"): a failed check raises `ConfigError` (a ValueError) whose message starts with the
field's dotted name, e.g. ``config.optim.eps: must be a number > 0, got 0``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ConfigError", "as_mapping", "check_section", "choice", "finite", "get", "increasing_steps",
    "integer", "lookup", "number",
]


class ConfigError(ValueError):
    """A config field has a bad value; the message starts with the field's dotted name."""


def get(section: Any, field: str, prefix: str) -> Any:
    """`section[field]` (dotted `field` descends), or ConfigError naming `prefix.field`."""
    node = section
    for part in field.split("."):
        if part not in node:
            raise ConfigError(f"{prefix}.{field}: missing")
        node = node[part]
    return node


def integer(section: Any, field: str, prefix: str, *, minimum: int = 1) -> int:
    """An int (not a bool) ≥ minimum."""
    value = get(section, field, prefix)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{prefix}.{field}: must be an integer >= {minimum}, got {value!r}")
    return value


def number(section: Any, field: str, prefix: str, *, minimum: float = 0.0,
           strict: bool = False) -> float:
    """An int or float (not a bool) ≥ minimum (> minimum when `strict`)."""
    value = get(section, field, prefix)
    bad = not isinstance(value, (int, float)) or isinstance(value, bool)
    if bad or value < minimum or (strict and value == minimum):
        op = ">" if strict else ">="
        raise ConfigError(f"{prefix}.{field}: must be a number {op} {minimum}, got {value!r}")
    return float(value)


def finite(section: Any, field: str, prefix: str) -> float:
    """A finite int or float (not a bool, NaN or ±inf); its range is the caller's check."""
    value = get(section, field, prefix)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{prefix}.{field}: must be a finite number, got {value!r}")
    return float(value)


def _number_list(section: Any, field: str, prefix: str, what: str, *, whole: bool = False,
            minimum: float = 0.0, strict: bool = False) -> tuple[Any, ...]:
    """A tuple or list of finite numbers (ints when `whole`; never bools) ≥ minimum (> when
    `strict`); `what` names them in the message (e.g. "batch sizes")."""
    value = get(section, field, prefix)
    kind = "integers" if whole else "numbers"
    op = ">" if strict else ">="
    ok = isinstance(value, (tuple, list)) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        and (isinstance(v, int) or not whole) and (v > minimum if strict else v >= minimum)
        for v in value)
    if not ok:
        raise ConfigError(f"{prefix}.{field}: must be a list of {kind} {op} {minimum:g} "
                          f"({what}), got {value!r}")
    return tuple(value)


def check_section(section: Any, prefix: str, *, integers: Mapping[str, int] | None = None,
                  finite_fields: Sequence[str] = (), switches: Sequence[str] = (),
                  lists: Mapping[str, tuple[str, bool, float, bool]] | None = None) -> None:
    """The type and sign of each present field: `integers` {field: least value}, `finite_fields`,
    `switches` (bools), `lists` {field: `_number_list`'s (what, whole, minimum, strict)}."""
    for field, least in (integers or {}).items():
        if field in section:
            integer(section, field, prefix, minimum=least)
    for field in finite_fields:
        if field in section:
            finite(section, field, prefix)
    for field in switches:  # True or False (not 0, 1 or a string)
        if field in section and not isinstance(section[field], bool):
            raise ConfigError(f"{prefix}.{field}: must be True or False, got "
                              f"{section[field]!r}")
    for field, (what, whole, low, strict) in (lists or {}).items():
        if field in section:
            _number_list(section, field, prefix, what, whole=whole, minimum=low, strict=strict)


def choice(section: Any, field: str, prefix: str, choices: tuple[str, ...]) -> str:
    """One of `choices`."""
    value = get(section, field, prefix)
    if value not in choices:
        raise ConfigError(f"{prefix}.{field}: unknown value {value!r}; known: {list(choices)}")
    return value


def increasing_steps(value: Any) -> bool:
    """Whether `value` is a tuple or list of strictly increasing ints (not bools) >= 0."""
    return isinstance(value, (tuple, list)) and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value) and list(
        value) == sorted(set(value))


_REQUIRED = object()  # `lookup`'s default: the field must be present


def as_mapping(config: Any) -> Mapping[str, Any]:
    """A ConfigDict or a mapping as a plain mapping."""
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def lookup(config: Mapping[str, Any], name: str, where: str, default: Any = _REQUIRED) -> Any:
    """`config[name]` unless missing or None, then `default` (none: ValueError naming `where`)."""
    if name in config and config[name] is not None:
        return config[name]
    if default is _REQUIRED:
        raise ValueError(f"{where}: missing field {name!r}")
    return default
