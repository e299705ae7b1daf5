"""Checkpoints: the only module that touches orbax.

A checkpoint at step s holds two items saved together with `ocp.args.Composite`:

- `state`: the train state pytree (step, examples seen, params, optimizer state, noise EMA)
  as sharded arrays (`StandardSave`; every process writes its shards);
- `meta`: a small JSON object with the host-side state needed for an exact resume
  (examples seen, batch-size schedule state, learning-rate coupling factor, ...).

Saves are asynchronous (the device-to-host copy happens in `save`, the file writes in the
background); `wait` blocks until they are durable and `close` waits too. orbax writes into
a temporary directory and renames it when complete, so a kill during a save leaves the
previous checkpoint as the latest one.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"


class Checkpointer:
    """A thin wrapper around `ocp.CheckpointManager` for (state, meta) checkpoints.

    Args:
      directory: where the step directories live (created if missing).
      max_to_keep: how many recent checkpoints to keep (None keeps all).
      async_save: write in the background (True) or block in `save` (False).
    """

    def __init__(self, directory: str, *, max_to_keep: int | None = 2, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of all complete checkpoints, ascending."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> bool:
        """Starts saving `state` and `meta` as checkpoint `step`; returns whether it saved."""
        return self._manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                          meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int | None, target: Any) -> tuple[Any, dict[str, Any]]:
        """Restores checkpoint `step` (latest when None) into the structure of `target`.

        `target` is a pytree of arrays or `jax.ShapeDtypeStruct`s with shardings: restored
        arrays get the same shardings, so the state lands where the train step expects it.
        """
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                          meta=ocp.args.JsonRestore()))
        return restored["state"], dict(restored["meta"])

    def wait(self) -> None:
        """Blocks until every started save is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
