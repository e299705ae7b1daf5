"""The one host loop: dispatch steps, read metrics late, evaluate, checkpoint, stop, resume.

What `Loop` owns and drives: docs/design.md, "The one loop". At step t with E examples seen
(host ints; the state on the device holds the same): evaluate if due; save a checkpoint if
due (after reading every pending metric, so a saved state never follows a non-finite loss);
stop if the budget is spent or `stop_fn` asked; feed the schedule the smoothed noise scale it
observes every `batch.adapt_every` steps; dispatch step t at the schedule's B; every
`log_every` steps read the metrics of all steps but the newest (the device never waits for
the host). The order is a function of the step number alone (never of timing), so a resumed
run does exactly what an uninterrupted one does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import ml_collections

from cbs.engine.driver import Deferred, Driver, Points
from cbs.engine.state import TrainState
from cbs.results import files, records
from cbs.runtime import checkpoint, fields, preemption, throughput, writer
from cbs.runtime.progress import DivergenceRule, DivergenceState

__all__ = [
    "ENDED", "DivergedError", "Loop", "StopFn", "config_hash", "ended_run", "noise_scale",
]

StopFn = Callable[[int, dict[str, Any]], bool]
ENDED = ("finished", "stopped", "diverged")  # "running", "preempted", "interrupted" resume


class DivergedError(FloatingPointError):
    """The run diverged (`cbs.runtime.progress.DivergenceRule`, or a non-finite gradient);
    the last checkpoint before it is kept."""

    def __init__(self, message: str, summary: dict[str, Any]):
        super().__init__(message)
        self.summary = summary
        self.step = summary.get("step")


class _Diverged(Exception):
    def __init__(self, record: dict[str, Any], reason: str):
        self.record, self.reason = record, reason


def config_hash(config: ml_collections.ConfigDict) -> str:
    """A short hash of the config's JSON (equal configs, equal hashes). `train.wandb` counts
    only when set: runs from before it existed keep their hash."""
    text = config.to_json(sort_keys=True)
    if config.get("train") is not None and config.train.get("wandb", None) == "":
        plain = json.loads(text)
        del plain["train"]["wandb"]
        text = json.dumps(plain, sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def ended_run(workdir: str, config: ml_collections.ConfigDict, *,
              raise_on_divergence: bool = True) -> dict[str, Any] | None:
    """The summary in `workdir`'s status.json when the run ended (`ENDED`) with this config,
    else None. A run that ended "diverged" raises its `DivergedError` again (a rerun would
    diverge at the same step) unless `raise_on_divergence` is False."""
    status = records.read_json(os.path.join(workdir, files.STATUS_FILE))
    if not (status and status.get("status") in ENDED
            and status.get("config_hash") == config_hash(config)):
        return None
    if status["status"] == "diverged" and raise_on_divergence:
        raise DivergedError(status.get("message", "diverged"), status)
    return status


def validate_train_config(train_config: Any) -> None:
    """Checks `config.train`; raises `fields.ConfigError` naming the first bad field."""
    at, t = "config.train", train_config
    fields.integer(t, "max_steps", at, minimum=0)
    fields.integer(t, "max_examples", at, minimum=0)
    if not (t.max_steps or t.max_examples):
        raise fields.ConfigError(f"{at}.max_steps: set it or train.max_examples (both are 0)")
    for field in ("log_every", "record_every", "checkpoint_every", "keep_checkpoints",
                  "divergence_patience"):
        fields.integer(t, field, at)
    if not isinstance(t.get("wandb", ""), str):
        raise fields.ConfigError(f'{at}.wandb: must be a W&B project name, or "" for none, '
                                 f"got {t.wandb!r}")
    fields.check_section(t, at, switches=("grad_norm",))
    factor = fields.number(t, "divergence_factor", at)
    if 0 < factor <= 1:
        raise fields.ConfigError(f"{at}.divergence_factor: must be 0 (off) or > 1, got {factor}")


def validate_eval_config(eval_config: Any) -> None:
    """Checks `config.eval`; raises `fields.ConfigError` naming the first bad field."""
    at = "config.eval"
    fields.integer(eval_config, "every", at, minimum=0)
    steps = eval_config.get("steps", ())
    if not fields.increasing_steps(steps):
        raise fields.ConfigError(f"{at}.steps: must be increasing integers >= 0, got "
                                 f"{steps!r}")
    fields.integer(eval_config, "batch_size", at)
    for name in ("num_examples", "train_examples"):
        fields.integer(eval_config, name, at, minimum=0)


class _ConfigPoints(NamedTuple):
    """The config's `Points` (the loop's default): `train.checkpoint_every`, and `eval.steps`
    when set, else `eval.every`."""

    config: ml_collections.ConfigDict

    def checkpoint_due(self, step: int) -> bool:
        return step % self.config.train.checkpoint_every == 0

    def evaluation_due(self, step: int) -> bool:
        steps, every = self.config.eval.get("steps", ()), self.config.eval.every
        return step in steps if steps else bool(every and step % every == 0)


@dataclasses.dataclass
class _Pending:
    kind: str  # "train" | "eval"
    step: int
    examples_seen: int
    deferred: Deferred  # device values, fetched at the next read, and their fields


def noise_scale(state: Any, name: str) -> float:
    """The smoothed noise scale `name` ("b_simple", "b_noise") a single run's state carries."""
    if not isinstance(state, TrainState):
        raise ValueError(f"a {type(state).__name__} state trains at a constant batch size: it "
                         f"observes no noise scale ({name})")
    ema = state.measure_ema if name == "b_noise" else state.noise_ema
    return float(jax.device_get(getattr(ema, name)))


class Loop:
    """One run of `driver` (a `Driver`, e.g. a `Trainer`) in `driver.workdir`.

    Args:
      stop_fn: stop_fn(step, record) -> bool, called on every record written; True stops.
      points: evaluations and checkpoints of the driver's own (default: the config's).
      read_each_evaluation: read every evaluation as soon as it is dispatched (a driver whose
        stopping depends on it), instead of up to `log_every` steps late.
      end: the step where the run should stop short of its budget, when known (for the bar).
      outputs, perf: the bar and mirrors, the throughput hooks (default: the config's).
      compilations: the number of compilations so far, for the summary.
    """

    sched_state: Any  # the schedule's state (`init`, `update`, `state_from_dict`)

    def __init__(self, driver: Driver, stop_fn: StopFn | None = None, *,
                 points: Points | None = None, read_each_evaluation: bool = False,
                 end: int | None = None, outputs: writer.Outputs | None = None,
                 perf: throughput.Perf | None = None,
                 compilations: Callable[[], int] | None = None):
        self.driver, self.config, self.stop_fn = driver, driver.config, stop_fn
        self.workdir = cast(str, driver.workdir)  # a Loop always runs in a directory
        self.points = points if points is not None else _ConfigPoints(self.config)
        self.read_each_evaluation, self.end = read_each_evaluation, end
        self.outputs = outputs or writer.Outputs.from_config(self.config)
        self.compilations = compilations
        self.primary = jax.process_index() == 0
        self.perf = perf or throughput.for_run(self.config, self.workdir)  # perf hook
        self.pending: list[_Pending] = []
        self.stop_requested = False
        self.last_train: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self.rule = DivergenceRule(float(self.config.train.divergence_factor),
                                   int(self.config.train.divergence_patience))
        self.divergence = DivergenceState()

    # ------------------------------------------------------------------ state

    def _restore_or_init(self) -> None:
        self.ckpt = checkpoint.Checkpointer(
            os.path.join(self.workdir, checkpoint.CHECKPOINT_DIR),
            max_to_keep=self.config.train.keep_checkpoints)
        self.schedule = self.driver.schedule
        latest = self.ckpt.latest_step()
        restore = None if latest is None else (
            lambda target: self.ckpt.restore(latest, target))
        self.state, meta = self.driver.start(restore)
        self.t, self.e = int(meta["step"]), int(meta["examples_seen"])
        if latest is None:
            self.sched_state, self.last_saved = self.schedule.init(), -1
        else:
            self.sched_state = self.schedule.state_from_dict(meta.get("schedule_state"))
            self.last_saved = self.t
            self.divergence = DivergenceState.from_dict(meta.get("divergence"))

    def _save(self) -> None:
        if self.primary:
            self.writer.sync()
        s = self.sched_state
        self.ckpt.save(self.t, self.state, {  # the host side of an exact resume
            "step": self.t, "examples_seen": self.e,
            "schedule_state": None if s is None else s.to_dict(),
            "config_hash": config_hash(self.config), "divergence": self.divergence.to_dict()})
        self.last_saved = self.t

    # ------------------------------------------------------------------ records

    def _read(self, *, keep_newest: bool) -> None:
        """Fetches pending metrics (all, or all but the newest step's), writes records."""
        n = len(self.pending)
        if keep_newest and n and self.pending[-1].kind == "train":
            n -= 1
        items, self.pending = self.pending[:n], self.pending[n:]
        if not items:
            return
        fetched = jax.device_get([it.deferred.values for it in items])
        records, every = [], self.config.train.record_every
        bad = None
        for item, values in zip(items, fetched, strict=True):  # the one place records are made
            base: dict[str, Any] = {"step": item.step, "kind": item.kind,
                                    "data/examples_seen": item.examples_seen}
            recs = [base | fields for fields in item.deferred.fields(values)]
            if item.kind == "train":
                self.last_train = rec = recs[0]
                bad = self._check_divergence(rec)
                if bad is None and item.step % every and "noise/b_simple" not in rec:
                    continue
            elif recs:
                self.last_eval = recs[-1]
            records.extend(recs)
            if bad is not None:
                break
        self.perf.annotate(records)  # perf hook: perf/* and data/tokens_seen when enabled
        self.writer.write(records)
        if self.stop_fn is not None:
            for r in records[:-1] if bad is not None else records:
                if self.stop_fn(r["step"], r):
                    self.stop_requested = True
        if bad is not None:
            raise _Diverged(records[-1], bad)

    def _check_divergence(self, rec: dict[str, Any]) -> str | None:
        """Feeds the rule one step's batch loss; the reason when the run has diverged."""
        self.divergence = self.rule.update(self.divergence, rec["train/loss"])
        if self.divergence.diverged:
            return self.divergence.reason
        grad_norm = rec.get("opt/grad_norm", 0.0)
        return None if math.isfinite(grad_norm) else f"non-finite gradient norm {grad_norm}"

    # ------------------------------------------------------------------ loop

    def _done(self) -> bool:
        tr = self.config.train
        return (self.stop_requested or bool(tr.max_steps and self.t >= tr.max_steps)
                or bool(tr.max_examples and self.e >= tr.max_examples))

    def _observe_noise(self) -> None:
        """Feeds the schedule the noise scale it `observes` every `batch.adapt_every` steps."""
        name, every = self.schedule.observes, self.config.batch.adapt_every
        if name is None or self.t == 0 or self.t % every:
            return
        value = noise_scale(self.state, name)
        self.sched_state = self.schedule.update(self.sched_state, value, self.e)

    def _advance(self) -> None:
        b = self.schedule.batch_size_at(self.e, self.sched_state)
        self.perf.at_step(self.t)  # perf hook: profiler trace window
        self.state, n, deferred = self.driver.advance(self.state, self.t, self.e, b)
        if deferred is not None:  # one step: its record is read later
            self.pending.append(_Pending("train", self.t, self.e, deferred))
        self.t, self.e = self.t + n, self.e + n * b

    def _iterate(self) -> None:
        c, tr = self.config, self.driver
        last_eval = -1
        while True:
            if preemption.requested():
                self._read(keep_newest=False)
                if self.t != self.last_saved:
                    self._save()
                raise preemption.Preempted(f"{preemption.reason()} at step {self.t}")
            done = self._done()
            evaluate = c.eval.enabled and (done or self.points.evaluation_due(self.t))
            evaluated = evaluate and self.t != last_eval
            if evaluated:
                last_eval = self.t
                self.pending.append(_Pending("eval", self.t, self.e,
                                             tr.evaluate_at(self.state, self.t)))
            save = done or self.points.checkpoint_due(self.t)
            if save or (evaluated and self.read_each_evaluation):
                self._read(keep_newest=False)
                if save and self.t != self.last_saved:
                    self._save()
                if self.stop_requested and not done:
                    continue
            if done:
                return
            self._observe_noise()
            self._advance()
            if self.t % c.train.log_every == 0:
                self._read(keep_newest=True)

    def _status(self, status: str, message: str = "", **changes: Any) -> dict[str, Any]:
        """The run's summary, written to status.json (process 0)."""
        summary = {"status": status, "step": self.t, "examples_seen": self.e,
                   "checkpoint_step": self.ckpt.latest_step(), "message": message,
                   "config_hash": config_hash(self.config), "last_train": self.last_train,
                   "last_eval": self.last_eval,
                   "compilations": self.compilations() if self.compilations else 0,
                   "elapsed_s": round(time.perf_counter() - self.start, 3)} | changes
        if self.primary:
            records.write_json_atomic(os.path.join(self.workdir, files.STATUS_FILE), summary)
        return summary

    def run(self, raise_on_divergence: bool = True) -> dict[str, Any]:
        """Runs to the end; returns the summary (also written to status.json)."""
        self.start = time.perf_counter()
        c = self.config
        outputs = self.outputs  # bar, TensorBoard, W&B
        if self.primary:
            outputs.check()  # a missing extra stops the run before any file
        self._restore_or_init()
        if self.primary:
            records.write_json_atomic(os.path.join(self.workdir, files.CONFIG_FILE),
                                      json.loads(c.to_json(sort_keys=True)))
        self.writer = outputs.open(self.workdir, start_step=self.t,
                                   total_steps=self.end or c.train.max_steps or None,
                                   enabled=self.primary,
                                   hparams=c.to_dict() if outputs.wandb else None)
        self._status("running")
        try:
            with preemption.active():
                self._iterate()
        except _Diverged as err:
            self.ckpt.wait()
            bad = err.record
            message = (f"diverged at step {bad['step']} (examples seen "
                       f"{bad['data/examples_seen']}): {err.reason}; train/loss="
                       f"{bad.get('train/loss')}, opt/grad_norm={bad.get('opt/grad_norm')}; the "
                       f"last good checkpoint is step {self.ckpt.latest_step()} in "
                       f"{self.ckpt.directory} (rule: config.train.divergence_factor, "
                       "divergence_patience)")
            summary = self._status("diverged", message, step=bad["step"])
            if raise_on_divergence:
                raise DivergedError(message, summary) from None
            return summary
        except preemption.Preempted as err:
            self.ckpt.wait()
            message = (f"{err}: checkpoint at step {self.ckpt.latest_step()} in "
                       f"{self.ckpt.directory}; rerun the same command to resume")
            summary = self._status(err.status, message)
            raise preemption.Preempted(message, summary) from None
        finally:
            self.perf.close()  # perf hook
            self.ckpt.close()
            self.writer.close()
        return self._status("stopped" if self.stop_requested else "finished")

