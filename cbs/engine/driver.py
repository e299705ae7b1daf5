"""The contract between the one training loop (`cbs.engine.loop.Loop`) and what it drives:
a single run (`cbs.engine.trainer.Trainer`), a sweep's vmapped group of trials
(`cbs.sweeps.groups.TrialGroup`) or the vmapped seeds of a branch
(`cbs.sweeps.branch_unit.VmappedBranch`).

`Driver` is what every driver implements. A driver may also keep its own evaluation and
checkpoint points (`OwnPoints`; otherwise the config's, `checkpoint_due` and
`evaluation_due`), adjust a restored state (`AdjustsRestored`), carry a smoothed noise
scale for a schedule that observes one (`ObservesNoise`) or know where it will stop before
its budget (`KnowsItsEnd`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import ml_collections

from cbs.data.dataset import Dataset
from cbs.engine import schedules

__all__ = [
    "AdjustsRestored", "Driver", "KnowsItsEnd", "ObservesNoise", "OwnPoints", "checkpoint_due",
    "evaluation_due",
]


class Driver(Protocol):
    """What `Loop` drives, and what every driver implements: the state (fresh, or the
    abstract arrays a checkpoint restores into), its dispatches and its evaluations. When
    to evaluate and to checkpoint is read from the config (`train.checkpoint_every`,
    `eval.every`, `eval.steps`) unless the driver keeps its own points (`OwnPoints`).

    Attributes: `config` (the run config: `train`, `eval`, `noise` and `batch.adapt_every`
    are read), `workdir`, `schedule` (`cbs.engine.schedules`), `dataset` and `mesh` (for the
    throughput hooks), `replicas` (data replicas); `read_each_evaluation`: read every
    evaluation as soon as it is dispatched (a driver whose stopping depends on it), instead
    of up to `log_every` steps late; `start_position`: (step, examples seen) of the state
    `init_state` gives ((0, 0) for a fresh run; a branch starts where its point is, so its
    budget `train.max_steps` counts from the reference run's step 0).
    """

    config: ml_collections.ConfigDict
    schedule: schedules.BatchSchedule
    dataset: Dataset
    mesh: jax.sharding.Mesh
    replicas: int
    read_each_evaluation: bool
    start_position: tuple[int, int]

    @property
    def workdir(self) -> str | None:
        """The run directory (a `Loop` needs one)."""

    def init_state(self) -> Any:
        """A fresh state on the device."""

    def restore_target(self) -> Any:
        """The state's abstract arrays (shapes, dtypes, shardings) to restore into."""

    def advance(self, state: Any, step: int, examples_seen: int, batch_size: int
                ) -> tuple[Any, int, Any]:
        """Dispatches the steps from `step` on: (state, number of steps, device metrics of a
        single step or None)."""

    def accum_steps(self, batch_size: int) -> int:
        """Micro-batches per step at batch size B (recorded as data/accum_steps)."""

    def evaluate_at(self, state: Any, step: int) -> Any:
        """Dispatches the evaluation at `step`; device values for `eval_records`."""

    def eval_records(self, values: Any) -> list[dict[str, Any]]:
        """The evaluation's record fields from fetched values (one dict per record)."""

    def num_compilations(self) -> int:
        """Compilations of the step so far."""


@runtime_checkable
class OwnPoints(Protocol):
    """A driver whose evaluations and checkpoints are not the config's (a sweep group's
    log-spaced evaluation points, a checkpoint every few of them)."""

    def checkpoint_due(self, step: int) -> bool:
        """Save a checkpoint at `step` (one is also saved at the end)."""

    def evaluation_due(self, step: int) -> bool:
        """Evaluate the parameters after `step` updates (also done at the end)."""


@runtime_checkable
class AdjustsRestored(Protocol):
    """A driver that adjusts a restored state for what the config may change on resume."""

    def restored(self, state: Any) -> Any:
        """The restored state, adjusted."""


@runtime_checkable
class ObservesNoise(Protocol):
    """A driver whose state carries a smoothed noise scale (for a schedule that observes
    one, `schedule.observes`)."""

    def noise_scale(self, state: Any, name: str) -> float:
        """The smoothed noise scale `name` ("b_simple", "b_noise") the state carries."""


@runtime_checkable
class KnowsItsEnd(Protocol):
    """A driver that can tell before it starts where it will stop short of its budget (a
    sweep's reference run repeats a trial whose crossing is recorded): the progress bar
    counts to that step, so its estimate is of the work that will run."""

    def expected_steps(self) -> int | None:
        """The step where the run should stop (None: unknown, the budget)."""


def checkpoint_due(config: ml_collections.ConfigDict, step: int) -> bool:
    """The config's checkpoints: every `train.checkpoint_every` steps."""
    return step % config.train.checkpoint_every == 0


def evaluation_due(config: ml_collections.ConfigDict, step: int) -> bool:
    """The config's evaluations: after the steps `eval.steps` when set, else every
    `eval.every` steps (0: only at the end)."""
    steps = config.eval.get("steps", ())
    if steps:
        return step in steps
    every = config.eval.every
    return bool(every and step % every == 0)
