"""A run of the engine as a base config plus typed overrides.

Everything that trains many runs from one config (sweep trials, vmapped trial groups, batch
ramps, branches) says how one run differs from the base with a `RunOverrides` and gets its run
config from `run_config`, the one place that copies a config and writes those fields:

    c = run_config(config, RunOverrides(batch_size=64, learning_rate=1e-3, seed=2))
    trainer.Trainer(c, workdir)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from cbs.engine.noise_spec import EXAMPLES
from cbs.runtime.fields import ConfigError, increasing_steps

__all__ = ["Coupling", "RunOverrides", "run_config"]


@dataclasses.dataclass(frozen=True)
class Coupling:
    """How the learning rate follows the batch size (`config.batch.lr_coupling`)."""

    rule: str  # "none" | "linear" | "sqrt" (see cbs.engine.lr)
    base_batch_size: int | None = None  # B_0, examples; 0 = the initial batch size
    cap: float | None = None  # largest learning rate allowed; 0 = no cap


def _at(path: str) -> Any:
    """An override (None: keep the base's value) that writes the config field `path`."""
    return dataclasses.field(default=None, metadata={"at": path})


@dataclasses.dataclass(frozen=True)
class RunOverrides:
    """How one run differs from its base config; None (or False for `quiet`) keeps the base.
    Each field writes the config field its `_at` names; a bad value raises
    `cbs.runtime.fields.ConfigError` naming the config field and the override."""

    batch_size: int | None = _at("batch.schedule.batch_size")  # B, as a constant schedule
    schedule: Mapping[str, Any] | None = _at("batch.schedule")  # not with batch_size
    micro_batch: int | None = _at("batch.micro_batch")  # m, examples per replica
    learning_rate: float | None = _at("optim.learning_rate")  # peak η_0
    lr_coupling: Coupling | None = _at("batch.lr_coupling")  # rule, B_0 and cap
    adapt_every: int | None = _at("batch.adapt_every")  # steps between noise observations
    seed: int | None = _at("seed")  # model initialisation and data order
    max_steps: int | None = _at("train.max_steps")  # step budget; 0 = none
    max_examples: int | None = _at("train.max_examples")  # example budget; 0 = none
    log_every: int | None = _at("train.log_every")  # steps between reads of the metrics
    record_every: int | None = _at("train.record_every")  # steps between train records
    checkpoint_every: int | None = _at("train.checkpoint_every")
    divergence_factor: float | None = _at("train.divergence_factor")  # 0 = never diverged
    keep_checkpoints: int | None = _at("train.keep_checkpoints")  # checkpoints kept on disk
    quiet: bool = dataclasses.field(  # True: the bar, TensorBoard and W&B off
        default=False, metadata={"at": "train.progress_bar"})
    eval_enabled: bool | None = _at("eval.enabled")  # evaluate at all
    eval_every: int | None = _at("eval.every")  # steps between evaluations; 0 = at the end
    eval_steps: tuple[int, ...] | None = _at("eval.steps")  # evaluate after these steps
    full_train_eval: bool | None = _at("eval.full_train")  # the training-set loss too
    noise_every: int | None = _at("noise.every")  # steps between measurements; 0 = never
    noise_batch_size: int | None = _at("noise.batch_size")  # examples measured; 0 = R·m
    noise_examples: str | None = _at("noise.examples")  # cbs.engine.noise_spec.EXAMPLES

    def __post_init__(self):
        for name in ("batch_size", "micro_batch", "adapt_every", "log_every", "record_every",
                     "checkpoint_every", "keep_checkpoints"):
            _integer(name, getattr(self, name), minimum=1)
        for name in ("seed", "max_steps", "max_examples", "eval_every", "noise_every",
                     "noise_batch_size"):
            _integer(name, getattr(self, name), minimum=0)
        if self.noise_examples is not None and self.noise_examples not in EXAMPLES:
            raise _error("noise_examples", f"must be one of {EXAMPLES}, got "
                                           f"{self.noise_examples!r}")
        _number("learning_rate", self.learning_rate, strict=True)
        _number("divergence_factor", self.divergence_factor)
        for name in ("quiet", "eval_enabled", "full_train_eval"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise _error(name, f"must be True or False, got {value!r}")
        if self.eval_steps is not None and not (isinstance(self.eval_steps, tuple)
                                                and increasing_steps(self.eval_steps)):
            raise _error("eval_steps", f"must be a tuple of increasing integers >= 0, got "
                                       f"{self.eval_steps!r}")
        if self.batch_size is not None and self.schedule is not None:
            raise _error("schedule", "give batch_size or schedule, not both")
        if self.schedule is not None and (not isinstance(self.schedule, Mapping)
                                          or "kind" not in self.schedule):
            raise _error("schedule", f"must be a mapping with a 'kind', got {self.schedule!r}")
        if self.lr_coupling is not None:
            if not isinstance(self.lr_coupling.rule, str):
                raise _error("lr_coupling.rule",
                             f"must be a string, got {self.lr_coupling.rule!r}")
            _integer("lr_coupling.base_batch_size", self.lr_coupling.base_batch_size, minimum=0)
            _number("lr_coupling.cap", self.lr_coupling.cap)


# The config field each override writes (error messages name both).
_FIELDS = {f.name: f.metadata["at"] for f in dataclasses.fields(RunOverrides)} | {
    f"lr_coupling.{k}": f"batch.lr_coupling.{k}" for k in ("rule", "base_batch_size", "cap")}


def _error(name: str, problem: str) -> ConfigError:
    return ConfigError(f"config.{_FIELDS[name]}: {problem} (override RunOverrides.{name})")


def _integer(name: str, value: Any, *, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _error(name, f"must be an integer >= {minimum}, got {value!r}")


def _number(name: str, value: Any, *, strict: bool = False) -> None:
    if value is None:
        return
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and (value > 0 if strict else value >= 0))
    if not ok:
        raise _error(name, f"must be a finite number {'> 0' if strict else '>= 0'}, "
                           f"got {value!r}")


def run_config(base: ml_collections.ConfigDict, overrides: RunOverrides, *,
               drop: Sequence[str] = ("sweep",)) -> ml_collections.ConfigDict:
    """A copy of `base` (with the sections of the studies that drive it, if any) with
    `overrides` written and the top-level sections `drop` left out."""
    c = ml_collections.ConfigDict(base.to_dict())
    for key in drop:
        if key in c:
            del c[key]
    o = overrides
    if o.batch_size is not None:
        c.batch.schedule = ml_collections.ConfigDict({"kind": "constant",
                                                      "batch_size": o.batch_size})
    if o.schedule is not None:
        c.batch.schedule = ml_collections.ConfigDict(dict(o.schedule))
    if o.quiet:
        c.train.progress_bar = False
        c.train.tensorboard = False
        if "wandb" in c.train:
            c.train.wandb = ""
    for name, path in _FIELDS.items():  # the plain fields: None keeps the base's value
        if name in ("batch_size", "schedule", "quiet") or name.startswith("lr_coupling"):
            continue
        section, field = path.rpartition(".")[::2]
        if (value := getattr(o, name)) is not None:
            (c[section] if section else c)[field] = value
    if o.lr_coupling is not None:
        c.batch.lr_coupling.rule = o.lr_coupling.rule
        for field in ("base_batch_size", "cap"):
            if (value := getattr(o.lr_coupling, field)) is not None:
                c.batch.lr_coupling[field] = value
    return c
