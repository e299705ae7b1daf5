"""Command-line entry points (`run(main, outputs=("workdir",))` instead of absl's
`app.run(main)`): a user error is one line and a non-zero exit; a bug keeps its traceback; a
failed command leaves no empty directories behind.

User errors (a `ValueError` raised by cbs or experiments code, an `OSError`, the `ImportError`
naming the install line of a missing extra) print `error: <message>` on stderr and exit with
status 2; `--verbose` or `CBS_VERBOSE=1` keeps their traceback. A stopped training exits 143
(SIGTERM) or 130 (Ctrl-C; `cbs.runtime.preemption`). orbax's log lines stay off the terminal
unless --verbose, and lines below WARNING unless --verbosity is given. `outputs` names the
flags of the directories the command writes: one it created that holds no file when it fails
is removed. docs/guides/faults.md ("Bad input", "Preemption and Ctrl-C") gives the details.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from absl import app, flags
from absl import logging as absl_logging

from cbs.results import paths, records
from cbs.runtime import preemption

__all__ = [
    "USER_ERROR_EXIT", "VERBOSE_ENV", "exit_on_help", "guarded",
    "is_missing_extra", "message", "required", "run",
]

VERBOSE_ENV = "CBS_VERBOSE"
USER_ERROR_EXIT = 2
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../cbs
_OUR_CODE = (_PACKAGE + os.sep, os.path.join(os.path.dirname(_PACKAGE), "experiments") + os.sep)

if "verbose" not in flags.FLAGS:
    flags.DEFINE_bool("verbose", False, f"Show tracebacks of user errors too (or {VERBOSE_ENV}=1).")


def required(flag: flags.FlagHolder[str | None]) -> str:
    """The value of a string flag marked required (absl refuses to start `main` without it)."""
    if flag.value is None:  # unreachable once absl has checked the flag; states the type
        raise app.UsageError(f"--{flag.name} is required")
    return flag.value


def _verbose() -> bool:
    """Whether user errors keep their tracebacks (--verbose or CBS_VERBOSE=1)."""
    on = os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    return on or bool(flags.FLAGS.is_parsed() and flags.FLAGS.verbose)


def _raised_in_our_code(err: BaseException) -> bool:
    frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]
    return bool(frames) and os.path.abspath(frames[-1].f_code.co_filename).startswith(_OUR_CODE)


def is_missing_extra(err: BaseException) -> bool:
    """The ImportError cbs raises for a missing extra (naming the `pip install` line)."""
    return (isinstance(err, ImportError) and "pip install" in str(err) and _raised_in_our_code(err))


def _is_user_error(err: BaseException) -> bool:
    """File-system errors, ValueErrors raised in cbs or experiments code, a missing extra."""
    return isinstance(err, OSError) or is_missing_extra(err) or (
        isinstance(err, ValueError) and _raised_in_our_code(err))


def message(err: BaseException) -> str:
    """The one-line message of a user error."""
    if isinstance(err, OSError) and err.filename and err.strerror:
        hint = {PermissionError: "; choose a location you can write to",
                NotADirectoryError: "; a file is in the way: choose another path",
                FileExistsError: "; a file is in the way: choose another path",
                IsADirectoryError: "; a directory is in the way: choose another path",
                }.get(type(err), "")
        code = errno.errorcode.get(err.errno, "") if err.errno else ""
        return f"{err.strerror}{f' ({code})' if code else ''}: {err.filename}{hint}"
    text = str(err).strip() or type(err).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def guarded(main: Callable[[list[str]], Any], outputs: Sequence[str] = ()
            ) -> Callable[[list[str]], Any]:
    """`main` with user errors turned into one line and exit status 2 (see the module doc)."""

    def wrapped(argv: list[str]) -> Any:
        values = [flags.FLAGS[n].value for n in outputs if n in flags.FLAGS]
        created = [p for v in values if isinstance(v, str) and v
                   if (p := paths.first_missing(v)) is not None]
        try:
            return main(argv)
        except preemption.Preempted as err:
            print(f"{err.status}: {message(err)}", file=sys.stderr)
            sys.exit(err.exit_status)
        except (KeyboardInterrupt, Exception) as err:
            for path in created:
                paths.remove_if_empty(path)
            if isinstance(err, KeyboardInterrupt):  # Ctrl-C outside training (preemption)
                print("interrupted (SIGINT): stopped outside training; what was written is "
                      "kept, rerun the same command to go on", file=sys.stderr)
                sys.exit(preemption.INTERRUPT_EXIT_STATUS)
            if _verbose() or not _is_user_error(err):
                raise
            print(f"error: {message(err)}", file=sys.stderr)
            sys.unraisablehook = lambda _: None  # orbax's unfinished writes, collected at exit
            sys.exit(USER_ERROR_EXIT)

    return wrapped


def _config_field_error(argv: Sequence[str], err: Exception) -> str:
    """One line for an override of a config field that does not exist."""
    text = str(err).replace("\\n", " ")
    key = text.strip("'\" ").split("'")[0]
    args = [a for a in argv[1:] if a.startswith("--") and "." in a.split("=")[0]]
    arg = next((a for a in args if f".{key}" in a.split("=")[0]), " ".join(args))
    hint = text[text.index("Did you mean"):].rstrip("'\" ") if "Did you mean" in text else (
        "check the name against the config file")
    return f"{arg}: no such config field; {hint}"


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing whose errors are one line and exit status 2."""
    try:
        return flags.FLAGS(argv)
    except Exception as err:
        text = (None if _verbose() else _config_file_error(argv, err)) or _flag_error(argv, err)
    print(f"error: {text}", file=sys.stderr)
    sys.exit(USER_ERROR_EXIT)


def _flag_error(argv: list[str], err: Exception) -> str:
    """The one line of a flag error; raises `err` (or its cause) when it keeps a traceback."""
    if isinstance(err, flags.Error):  # the first user error inside the flag library's wrappers
        cause = next((c for c in records.exception_chain(err) if _is_user_error(c)), err)
        if _verbose() and cause is not err:
            raise cause from None
        return message(cause)
    if isinstance(err, (AttributeError, KeyError, TypeError)):
        if _verbose():
            raise err
        return _config_field_error(argv, err)
    if _verbose() or not _is_user_error(err):
        raise err
    return message(err)


def _config_file_error(argv: Sequence[str], err: BaseException) -> str | None:
    """`FILE:LINE: error` for a syntax error in `err`'s chain, or a bug raised by a line of
    the --config file itself; else None."""
    configs = [os.path.abspath(a.split("=", 1)[1].split(":")[0]) for a in argv[1:]
               if a.startswith("--config=")]
    for chain in records.exception_chain(err):
        if isinstance(chain, SyntaxError) and chain.filename:
            return f"{chain.filename}:{chain.lineno}: {type(chain).__name__}: {chain.msg}"
        at = [f"{frame.f_code.co_filename}:{line}"
              for frame, line in traceback.walk_tb(chain.__traceback__)
              if os.path.abspath(frame.f_code.co_filename) in configs]
        if at and not _is_user_error(chain):  # a user error says what to do
            return f"{at[-1]}: {type(chain).__name__}: {message(chain)}"
    return None


def _not_from_quiet_library(record: logging.LogRecord) -> bool:
    """A log filter: orbax's and asyncio's lines reach stderr only with --verbose."""
    return _verbose() or not (record.name.startswith("asyncio")
                             or f"{os.sep}orbax{os.sep}" in record.pathname)


def _quiet_closed_loops(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`hook` minus tensorstore's write-callback tracebacks after orbax's event loop closed."""

    def quiet(unraisable: Any) -> None:
        err = unraisable.exc_value
        if _verbose() or not (isinstance(err, RuntimeError) and str(err) == "Event loop is closed"):
            hook(unraisable)

    return quiet


def run(main: Callable[[list[str]], Any], *, outputs: Sequence[str] = ()) -> None:
    """`absl.app.run(main)` with everything the module docstring describes."""
    exit_on_help(main, sys.argv)
    preemption.install()
    absl_logging.get_absl_handler().addFilter(_not_from_quiet_library)
    sys.unraisablehook = _quiet_closed_loops(sys.unraisablehook)

    def quiet_main(argv: list[str]) -> Any:  # WARNING unless --verbosity: absl's INFO has
        if not flags.FLAGS["verbosity"].present:  # orbax's every save, gcsfs's every read
            absl_logging.set_verbosity(absl_logging.WARNING)
        return main(argv)

    app.run(guarded(quiet_main, outputs), flags_parser=_parse_flags)


_HELP_FLAGS = ("--help", "-help", "-h", "--helpshort", "-?")


def _command_help(module_name: str, program: str) -> str:
    """Its module's docstring, the flags that module defines, then those of every command."""
    module = sys.modules[module_name]
    own = flags.FLAGS.get_key_flags_for_module(module)
    lines = [f"usage: {program} [flags]", "", (module.__doc__ or "").strip(), "", "flags:"]
    for flag in sorted(own, key=lambda f: f.name):
        lines.append(_flag_help(flag))
        if flag.name == "config":
            lines.append("  --config.FIELD=VALUE: overrides one field of the config (dotted, e.g."
                         " --config.train.max_steps=100).")
    lines += ["", "every command:", _flag_help(flags.FLAGS["verbose"]),
              "  --helpfull: all flags, including those of absl and the libraries cbs uses."]
    return "\n".join(lines)


def _flag_help(flag: flags.Flag) -> str:
    """One flag as `--name: help (default: value)`, wrapped under its name."""
    name = f"--[no]{flag.name}" if flag.boolean else f"--{flag.name}"
    default = "" if flag.default is None else f" (default: {flag.default_as_str})"
    text = " ".join(f"{name}: {flag.help}{default}".split())
    return "\n".join(textwrap.wrap(text, 98, initial_indent="  ", subsequent_indent="      "))


def exit_on_help(main: Callable[[list[str]], Any], argv: Sequence[str]) -> None:
    """On `--help` (`_HELP_FLAGS`), before parsing flags: `_command_help` of `main`, exit 0."""
    if not any(a in _HELP_FLAGS for a in argv[1:]):
        return
    program = os.path.basename(argv[0]) if argv else "cbs"
    if program.endswith(".py") or program == "__main__":
        program = f"python -m {main.__module__}"
    print(_command_help(main.__module__, program))
    sys.exit(0)
