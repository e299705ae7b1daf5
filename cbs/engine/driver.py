"""The contract between the one training loop (`cbs.engine.loop.Loop`) and what it drives
(a `cbs.engine.trainer.Trainer`, a sweep's `cbs.sweeps.groups.TrialGroup`, a branch's
`cbs.sweeps.branch_unit.VmappedBranch`; docs/design.md, "The one loop").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import ml_collections

from cbs.engine import schedules

__all__ = ["Deferred", "Driver", "Points", "Restore"]

# restore(target) -> (state, checkpoint metadata): the loop's checkpoint restored into the
# abstract arrays `target` (shapes, dtypes, shardings)
Restore = Callable[[Any], tuple[Any, dict[str, Any]]]


class Deferred(NamedTuple):
    """What a dispatch leaves to read later: device values, and `fields(fetched values)` ->
    the record fields they make (one dict per record)."""

    values: Any
    fields: Callable[[Any], list[dict[str, Any]]]


class Driver(Protocol):
    """What `Loop` drives: a run config (`train`, `eval` and `batch.adapt_every` are read), a
    run directory, a batch schedule, a state, its dispatches and its evaluations."""

    config: ml_collections.ConfigDict
    schedule: schedules.BatchSchedule

    @property
    def workdir(self) -> str | None: ...

    def start(self, restore: Restore | None) -> tuple[Any, dict[str, Any]]:
        """(state, metadata): a fresh state with {"step", "examples_seen"} of where it starts
        when `restore` is None; else the checkpoint `restore` reads into this driver's
        abstract state, adjusted for what the config may change on resume, and its metadata."""

    def advance(self, state: Any, step: int, examples_seen: int, batch_size: int
                ) -> tuple[Any, int, Deferred | None]:
        """Dispatches the steps from `step` on: (state, number of steps, the train record's
        fields of a single step, or None)."""

    def evaluate_at(self, state: Any, step: int) -> Deferred:
        """Dispatches the evaluation of the parameters after `step` updates."""


@runtime_checkable
class Points(Protocol):
    """Evaluations and checkpoints that are not the config's (a sweep group's log-spaced
    evaluation points, a checkpoint every few of them): a `Loop` argument."""

    def checkpoint_due(self, step: int) -> bool:
        """Save a checkpoint at `step` (one is also saved at the end)."""

    def evaluation_due(self, step: int) -> bool:
        """Evaluate the parameters after `step` updates (also done at the end)."""
