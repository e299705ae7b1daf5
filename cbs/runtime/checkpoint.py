"""Checkpoints: the only module that touches orbax.

A checkpoint at step s holds `state`, the train state pytree as sharded arrays (every process
writes its shards), and `meta`, a JSON object with the host-side state of an exact resume
(`cbs.engine.loop.Loop`). Saves are asynchronous; `wait` (and `close`) block until they are
durable. orbax completes a checkpoint by a rename (on gs://, a commit file written last), so a
kill during a save leaves the previous one as the latest.

Restoring the latest checkpoint survives damage: one that cannot be read is skipped with a
`SkippedCheckpointWarning`, moved aside to `checkpoints.skipped/<step>` (so that step can be saved
again), and the newest intact one before it is restored (at least `_MIN_TO_KEEP` are kept). Arrays
of another model are not damage: `CheckpointMismatchError`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp

from cbs.results import paths, records
from cbs.results.paths import PathLike

__all__ = [
    "CHECKPOINT_DIR", "SKIPPED_SUFFIX", "CheckpointMismatchError", "Checkpointer",
    "SkippedCheckpointWarning",
]

CHECKPOINT_DIR = "checkpoints"
SKIPPED_SUFFIX = ".skipped"  # damaged checkpoints go to <directory>.skipped/<step>
_MIN_TO_KEEP = 2  # the newest checkpoint plus one to fall back to


class CheckpointMismatchError(ValueError):
    """The checkpoint holds arrays of another model (tree or shapes differ)."""


class SkippedCheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older one."""


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """'params/w' -> shape for every array leaf of `tree` (dataclass fields as dict keys)."""
    name = lambda k: str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))
    return {"/".join(map(name, path)): tuple(getattr(v, "shape", ()))
            for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _difference(stored: dict, wanted: dict) -> str:
    """A short description of how two {path: shape} maps differ ('' if they match)."""
    parts = [f"{k}: checkpoint {stored[k]}, model {wanted[k]}"
             for k in sorted(set(stored) & set(wanted)) if stored[k] != wanted[k]]
    for where, only in (("the checkpoint", set(stored) - set(wanted)),
                        ("the model", set(wanted) - set(stored))):
        if only:
            more = f" (+{len(only) - 3})" if len(only) > 3 else ""
            parts.append(f"only in {where}: {', '.join(sorted(only)[:3])}{more}")
    return "; ".join(parts[:3])


def _reason(err: BaseException) -> str:
    text = " ".join(str(err).split()) or "no message"
    return f"{type(err).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"


class _Manager(ocp.CheckpointManager):
    """orbax's manager without its own calls of JAX's preemption sync point, whose call count
    `cbs.runtime.preemption` keeps (the loop saves with force=True)."""

    def reached_preemption(self, step: int) -> bool:
        del step
        return False


class Checkpointer:
    """(state, meta) checkpoints in `directory` (local or gs://), keeping the `max_to_keep`
    newest (None: all; at least _MIN_TO_KEEP); async_save: write in the background."""

    def __init__(self, directory: PathLike, *, max_to_keep: int | None = 2,
                 async_save: bool = True):
        self.directory = (os.fspath(directory) if paths.is_remote(directory)
                          else os.path.abspath(directory))
        if max_to_keep is not None:
            max_to_keep = max(_MIN_TO_KEEP, int(max_to_keep))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save)
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = _Manager(paths.epath(self.directory), options=options,
                                 item_handlers=handlers)

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of all complete checkpoints, ascending."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> bool:
        """Starts saving checkpoint `step`; returns whether it saved. An OS error (a full disk)
        raises OSError naming the file, here or from `wait` and `close`."""
        with self._os_errors():
            return self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    @contextlib.contextmanager
    def _os_errors(self):
        try:
            yield
        except Exception as err:
            found = _os_error(err)
            if found is None:
                raise
            raise records.write_error(found, found.filename or self.directory) from None

    def restore(self, step: int | None, target: Any) -> tuple[Any, dict[str, Any]]:
        """Restores checkpoint `step` (latest when None) into `target`, a pytree of arrays or
        `jax.ShapeDtypeStruct`s whose shardings the restored arrays get. For the latest, a
        damaged checkpoint is skipped for an older one: read the step from the returned meta."""
        latest = self.latest_step()
        step = latest if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        held = self.all_steps()
        if step != latest and step not in held:
            raise ValueError(f"no checkpoint at step {step} in {self.directory}: it holds "
                             + (f"{_steps_text(held)}; ask for one of those" if held else "none"))
        candidates = [s for s in reversed(held) if s <= step] if step == latest else [step]
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        skipped: list[tuple[int, str]] = []
        mismatch = ""
        for s in candidates:
            why = self._mismatch(s, abstract)
            if why:  # another model's, or metadata too damaged to say
                mismatch = mismatch or (f"step {s}: {why}" if why[0] != "!" else "")
                skipped.append((s, why.lstrip("!")))
                continue
            try:
                restored = self._manager.restore(s, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
            except Exception as err:  # a file cut short or garbled: damaged
                skipped.append((s, _reason(err)))
                continue
            self._set_aside(skipped, s)  # an older one matched: the newer ones are damage
            return restored["state"], dict(restored["meta"])
        if mismatch:
            raise CheckpointMismatchError(
                f"{os.path.dirname(self.directory)} holds another model's checkpoint "
                f"({mismatch}); use a new workdir for this model, or delete "
                f"{self.directory} to start over")
        reasons = "; ".join(f"step {s}: {why}" for s, why in skipped)
        if step != latest:  # one checkpoint asked for: the others may be intact
            raise ValueError(f"checkpoint {step} in {self.directory} cannot be read "
                             f"({reasons}); it also holds "
                             f"{_steps_text([s for s in held if s != step]) or 'none'}")
        raise ValueError(f"no intact checkpoint in {self.directory} ({reasons}); delete it to "
                         "start over")

    def _mismatch(self, step: int, abstract: Any) -> str:
        """'' when `step`'s arrays match `abstract`, else how they differ, or '!why' unreadable."""
        try:
            stored = _shapes(self._manager.item_metadata(step)["state"])
        except Exception as err:
            return "!" + _reason(err)
        if not stored:
            return "!no arrays in its metadata"
        return _difference(stored, _shapes(abstract))

    def _set_aside(self, skipped: list[tuple[int, str]], restored: int) -> None:
        """Moves damaged checkpoints out of the way (so their steps can be saved again)."""
        if not skipped:
            return
        aside = self.directory + SKIPPED_SUFFIX
        for s, why in skipped:
            where = paths.join(aside, str(s))
            if jax.process_index() == 0:
                paths.makedirs(aside)
                paths.rmtree(where)
                paths.move(paths.join(self.directory, str(s)), where)
            warnings.warn(f"skipped the damaged checkpoint at step {s} in {self.directory} "
                          f"({why}); moved it to {where}; resuming from step {restored}",
                          SkippedCheckpointWarning, stacklevel=3)
        self._manager.reload()

    def wait(self) -> None:
        """Blocks until every started save is durable."""
        with self._os_errors():
            self._manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()


_NO_SPACE = ("No space left on device", "RESOURCE_EXHAUSTED", "Disk quota exceeded")


def _os_error(err: BaseException) -> OSError | None:
    """The OS error behind an orbax/tensorstore failure (an OSError in its chain, or one made
    from a message that says the disk is full); None for anything else (a bug)."""
    chain = list(records.exception_chain(err))
    found = [c for c in chain if isinstance(c, OSError) and c.errno]
    for c in found:
        if c.filename:
            return c
    code = found[0].errno if found else None
    text = " ".join(map(str, chain))
    if code is None and any(s in text for s in _NO_SPACE):
        code = errno.EDQUOT if "quota" in text else errno.ENOSPC
    if code is None and "File too large" in text:  # a file size limit (ulimit -f)
        code = errno.EFBIG
    if code is None:
        return None
    named = _WRITING.search(text)
    return OSError(code, os.strerror(code), *([named.group(1)] if named else []))


_WRITING = re.compile(r'(?:writing|write to) (?:local )?file "([^"]+)"', re.IGNORECASE)


def _steps_text(steps: list[int]) -> str:
    """"steps 10 and 20", "steps 5, 10, 15, ..., 995, 1000 (200 checkpoints)", ""."""
    if not steps:
        return ""
    if len(steps) == 1:
        return f"step {steps[0]} only"
    if len(steps) > 8:
        head, tail = ", ".join(map(str, steps[:3])), ", ".join(map(str, steps[-2:]))
        return f"steps {head}, ..., {tail} ({len(steps)} checkpoints)"
    return f"steps {', '.join(map(str, steps[:-1]))} and {steps[-1]}"
