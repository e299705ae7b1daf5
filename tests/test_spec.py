"""Tests of cbs.engine.spec: the run configs that sweeps, trial groups, ramps, the launcher's
check and branches build through `run_config` equal, field by field, those of the code that
edited copied configs in place (kept below as the pre-refactor reference); `run_config` never
changes its base; a bad override is refused with the field's name."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import types

import ml_collections
import numpy as np
import pytest

from cbs.engine import loop, spec
from cbs.engine import state as counts
from cbs.engine.noise_spec import NoiseSpec
from cbs.sweeps import branch_config, branch_unit, branches, grid, groups, launch, ramps, trials
from cbs.sweeps.grid import Trial
from experiments.configs import digits_branch, digits_ramps

# ---------------------------------------------------------------- pre-refactor reference
# Verbatim copies of the config edits as they were before `cbs.engine.spec`, kept as the
# reference the new code must reproduce.


def old_trial_config(config, trial, *, replicas=1):
    sweep = config.sweep
    c = ml_collections.ConfigDict(config.to_dict())
    del c["sweep"]
    c.seed = trial.seed
    c.optim.learning_rate = trial.learning_rate
    c.batch.micro_batch = trials.micro_batch_for(trial.batch_size, config.batch.micro_batch,
                                                 replicas)
    c.batch.schedule = ml_collections.ConfigDict({"kind": "constant",
                                                  "batch_size": trial.batch_size})
    c.batch.lr_coupling.rule = "none"
    c.train.max_steps = trials.step_budget(sweep, trial.batch_size)
    c.train.max_examples = 0
    every = trials.eval_every(sweep, trial.batch_size)
    c.eval.every = every
    c.eval.full_train = sweep.target_metric == "full_train/loss"
    c.train.log_every = min(c.train.log_every, every)
    c.train.progress_bar = False
    c.train.tensorboard = False
    c.train.divergence_factor = 0.0
    if c.noise.every or _at_evals(config):
        c.noise.every = every if _at_evals(config) else 0
        c.noise.batch_size = 0
    return c


def _at_evals(config) -> bool:
    """Whether a trial measures at its evaluations (before the measurement settings moved
    to config.noise: `sweep.noise_batch_size` > 0)."""
    return NoiseSpec.from_config(config.noise).measures_at_evals


def _measured_at_evaluations(c, config, trial):
    """The intended changes since the reference: an engine trial no longer measures the
    noise in its step (noise.every) but at its evaluations, as a vmapped group does
    (`cbs.engine.measure`), so those evaluations are on; and it evaluates on the group's
    log-spaced grid (eval.steps). Since the measurement settings moved to config.noise,
    noise.batch_size is the evaluations' n and the trial keeps it."""
    c.eval.steps = tuple(trials.eval_steps(config.sweep, trial.batch_size))
    if config.noise.every or _at_evals(config):
        c.noise.every = 0
        c.noise.batch_size = config.noise.batch_size
    if _at_evals(config):
        c.eval.enabled = True
    return c


def old_ramp_config(config, run, sweep_dir):
    sweep = config.sweep
    c = ml_collections.ConfigDict(config.to_dict())
    for key in ("sweep", "ramps"):
        if key in c:
            del c[key]
    c.batch.schedule = ml_collections.ConfigDict(dict(run["schedule"]))
    c.batch.micro_batch = int(run.get("micro_batch", c.batch.micro_batch))
    c.optim.learning_rate = ramps._learning_rate(run["learning_rate"], sweep_dir)
    c.seed = int(run.get("seed", c.seed))
    coupling = dict(run.get("lr_coupling", {"rule": "none"}))
    c.batch.lr_coupling.rule = coupling.get("rule", "none")
    c.batch.lr_coupling.base_batch_size = int(coupling.get("base_batch_size", 0))
    c.batch.lr_coupling.cap = float(coupling.get("cap", 0.0))
    c.train.max_steps = int(run.get("max_steps", sweep.max_steps))
    c.train.max_examples = int(run.get("max_examples", sweep.max_examples))
    c.eval.every = int(run.get("eval_every", 5))
    c.batch.adapt_every = int(run.get("adapt_every", c.batch.adapt_every))
    c.eval.full_train = sweep.target_metric == "full_train/loss"
    c.train.log_every = min(c.train.log_every, c.eval.every)
    c.train.progress_bar = False
    c.train.tensorboard = False
    c.noise.examples = "step"  # intended since the move to config.noise: a ramp measures
    #                            only on the step's examples, never at its evaluations
    return c


def old_check_configs(config, base_trials):
    out = []
    for b in sorted({t.batch_size for t in base_trials}):
        c = ml_collections.ConfigDict(config.to_dict())
        del c["sweep"]
        c.optim.learning_rate = base_trials[0].learning_rate
        c.batch.micro_batch = b
        c.batch.schedule = ml_collections.ConfigDict({"kind": "constant", "batch_size": b})
        c.noise.every = 0  # (noise.batch_size, the evaluations' n, is kept since the move)
        out.append(c)
    return out


def old_group_config(config, trial):
    c = old_trial_config(config, trial, replicas=1)
    c.noise.every = 0
    c.noise.batch_size = config.noise.batch_size  # kept since the move: the evaluations' n
    c.eval.enabled = True  # set after the Trainer was built, on the same object
    c.eval.steps = tuple(trials.eval_steps(config.sweep, trial.batch_size))
    return c


def old_branch_config(config, max_k, bsz):
    c = copy.deepcopy(config)
    c.noise.every = 0
    c.batch.schedule.batch_size = max_k * bsz
    c.eval.enabled = False
    return c


def old_reference_config(config):
    c = copy.deepcopy(config)
    c.train.keep_checkpoints = 1_000_000
    return c

# ---------------------------------------------------------------- helpers


class _Built(Exception):
    """Raised by a stand-in Trainer once it has seen its config."""


def _capture(monkeypatch, owner, name: str) -> list[ml_collections.ConfigDict]:
    """Replaces `owner.<name>` (a Trainer or RunParts) by one that records its config and
    stops."""
    seen: list[ml_collections.ConfigDict] = []

    def fake(config, *args, **kwargs):
        seen.append(copy.deepcopy(config))
        raise _Built

    monkeypatch.setattr(owner, name, fake)
    return seen


def _same(new: ml_collections.ConfigDict, old: ml_collections.ConfigDict) -> None:
    assert new.to_dict() == old.to_dict()
    assert loop.config_hash(new) == loop.config_hash(old)  # resumes see the same run


def _sweep_config(name: str) -> ml_collections.ConfigDict:
    if name.startswith("mnist1d"):
        pytest.importorskip("mnist1d")
    return importlib.import_module(f"experiments.configs.{name}").get_config("tiny")


def _variants(config):
    """The config as given, with the noise measurement switched each way, and with metrics
    read every step (below any evaluation interval)."""
    yield config
    c = copy.deepcopy(config)
    c.train.log_every = 1
    yield c
    for every, size in ((0, 0), (5, 0), (0, 16)):
        c = copy.deepcopy(config)
        c.noise.every, c.noise.batch_size = every, size or 8
        if not size:  # no measurement at the evaluations
            c.noise.examples = "step"
        yield c

# ---------------------------------------------------------------- the run configs


@pytest.mark.parametrize("name", ["digits_sweep", "shakespeare_kaplan", "mnist1d_sweep"])
def test_trial_configs_equal_the_pre_refactor_ones(name):
    for config in _variants(_sweep_config(name)):
        base = copy.deepcopy(config.to_dict())
        for trial in grid.make_trials(config.sweep):
            for replicas in (1, 2):
                if trial.batch_size % replicas:
                    continue
                _same(trials.trial_config(config, trial, replicas=replicas),
                      _measured_at_evaluations(
                          old_trial_config(config, trial, replicas=replicas), config, trial))
        assert config.to_dict() == base


def test_ramp_configs_equal_the_pre_refactor_ones(monkeypatch):
    monkeypatch.setattr(ramps, "best_learning_rate", lambda sweep_dir, b: 1e-4 * b)
    config = digits_ramps.get_config("tiny")
    runs = [dict(r) for r in config.ramps]
    runs.append({"label": "every field", "schedule": {"kind": "linear", "start": 16,
                                                      "end": 64, "over": 1000},
                 "learning_rate": 3e-3, "micro_batch": 8, "seed": 7, "max_steps": 9,
                 "max_examples": 500, "eval_every": 2, "adapt_every": 3,
                 "lr_coupling": {"rule": "linear", "base_batch_size": 16, "cap": 0.1}})
    assert len(runs) > 3
    for run in runs:
        _same(ramps.ramp_config(config, run, "unused"), old_ramp_config(config, run, "unused"))


def test_the_launch_check_validates_the_pre_refactor_configs(monkeypatch):
    config = _sweep_config("digits_sweep")
    config.noise.every, config.noise.batch_size = 5, 8  # every switched off by the check
    seen = []
    monkeypatch.setattr(launch.config_lib, "validate", lambda c, **kw: seen.append(c))
    base_trials = launch.check_config(config)
    old = old_check_configs(config, base_trials)
    assert len(seen) == len(old) > 1
    for new, ref in zip(seen, old, strict=True):
        _same(new, ref)


def test_a_trial_group_builds_its_trainer_from_the_pre_refactor_config(monkeypatch):
    config = _sweep_config("digits_sweep")
    config.noise.batch_size = 16  # measured at the evaluations
    config.eval.enabled = False  # the group turns evaluations on
    seen = _capture(monkeypatch, groups, "RunParts")
    t = grid.make_trials(config.sweep)[1]
    with pytest.raises(_Built):
        groups.TrialGroup(config, [t], store=types.SimpleNamespace(sweep_dir="unused"))
    _same(seen[0], old_group_config(config, t))


def test_branch_configs_equal_the_pre_refactor_ones(monkeypatch, tmp_path):
    config = digits_branch.get_config("tiny")
    base = copy.deepcopy(config.to_dict())
    seen = _capture(monkeypatch, branches, "RunParts")
    with pytest.raises(_Built):
        branches.BranchRunner(config, str(tmp_path))
    ks = [int(k) for k in config.branch.ks]
    old = old_branch_config(config, ks[-1], branch_config.reference_batch(config))
    _same(seen[0], old)
    seen = _capture(monkeypatch, branches.trainer, "Trainer")
    with pytest.raises(_Built):
        branches.run_reference(config, str(tmp_path))
    _same(seen[0], old_reference_config(config))
    assert config.to_dict() == base


def test_a_branch_is_its_study_config_with_the_branch_fields_overridden():
    """A branch's run config (`branch_unit.branch_overrides`): the branch config of the
    study with the batch size, rate, seed, budget, records, checkpoints, divergence rule and
    final evaluation of the branch written, and nothing else."""
    config = digits_branch.get_config("tiny")
    study = old_branch_config(config, 4, branch_config.reference_batch(config))
    start = types.SimpleNamespace(step=np.int32(20), examples_seen=counts.count_from_int(320))
    o = branch_unit.branch_overrides(start, batch_size=64, learning_rate=3e-3, num_steps=5,
                                     full_train=True, seed=9)
    c = spec.run_config(study, o, drop=())
    want = copy.deepcopy(study)
    want.batch.schedule = ml_collections.ConfigDict({"kind": "constant", "batch_size": 64})
    want.optim.learning_rate, want.seed = 3e-3, 9
    t = want.train
    t.max_steps, t.max_examples, t.record_every, t.log_every = 25, 0, 1, 5
    t.checkpoint_every, t.divergence_factor = 25, 0.0  # no checkpoint before the end
    t.progress_bar = t.tensorboard = False
    want.eval.enabled, want.eval.every, want.eval.full_train = True, 0, True
    _same(c, want)
    c = spec.run_config(study, branch_unit.branch_overrides(
        start, batch_size=64, learning_rate=3e-3, num_steps=5, full_train=False,
        evaluate=False), drop=())
    assert (c.seed, c.eval.enabled, c.eval.full_train) == (study.seed, False, False)

# ---------------------------------------------------------------- run_config itself


def test_run_config_writes_a_copy_and_keeps_unset_fields():
    config = _sweep_config("digits_sweep")
    base = copy.deepcopy(config.to_dict())
    every = spec.RunOverrides(
        batch_size=64, micro_batch=16, learning_rate=0.5, seed=3, max_steps=7,
        max_examples=0, eval_every=2, eval_enabled=False, full_train_eval=False, log_every=1,
        divergence_factor=0.0, keep_checkpoints=4, quiet=True, noise_every=2,
        noise_batch_size=32, adapt_every=5,
        lr_coupling=spec.Coupling("sqrt", base_batch_size=16, cap=1.0))
    c = spec.run_config(config, every)
    assert config.to_dict() == base  # the base is never changed
    assert "sweep" not in c and "sweep" in config
    assert c.batch.schedule.to_dict() == {"kind": "constant", "batch_size": 64}
    assert (c.batch.micro_batch, c.optim.learning_rate, c.seed) == (16, 0.5, 3)
    assert c.batch.lr_coupling.to_dict() == {"rule": "sqrt", "base_batch_size": 16, "cap": 1.0}
    assert not (c.train.progress_bar or c.train.tensorboard or c.eval.enabled)
    assert (c.noise.every, c.noise.batch_size, c.train.keep_checkpoints) == (2, 32, 4)
    c.optim.learning_rate = 9.0  # the copy shares nothing with the base
    c.model.hidden_sizes = (1,)
    assert config.to_dict() == base
    same = spec.run_config(config, spec.RunOverrides(), drop=())
    assert same.to_dict() == base and same is not config


def test_a_ramp_schedule_is_copied_whole():
    config = _sweep_config("digits_sweep")
    steps = {"kind": "step", "steps": ((0, 16), (100, 32))}
    c = spec.run_config(config, spec.RunOverrides(schedule=steps))
    assert c.batch.schedule.to_dict() == steps


@pytest.mark.parametrize("field, value, message", [
    ("batch_size", 0, r"config\.batch\.schedule\.batch_size: must be an integer >= 1, got 0"),
    ("micro_batch", 2.0, r"config\.batch\.micro_batch: .*RunOverrides\.micro_batch"),
    ("learning_rate", 0.0, r"config\.optim\.learning_rate: must be a finite number > 0"),
    ("learning_rate", float("nan"), r"config\.optim\.learning_rate"),
    ("max_steps", -1, r"config\.train\.max_steps: must be an integer >= 0"),
    ("eval_every", True, r"config\.eval\.every"),
    ("eval_steps", (3, 1), r"config\.eval\.steps: must be a tuple of increasing integers"),
    ("eval_steps", [1, 2], r"config\.eval\.steps"),
    ("noise_batch_size", -2, r"config\.noise\.batch_size"),
    ("eval_enabled", 1, r"config\.eval\.enabled: must be True or False"),
    ("divergence_factor", -1.0, r"config\.train\.divergence_factor"),
    ("schedule", {"batch_size": 4}, r"config\.batch\.schedule: must be a mapping with a 'kind'"),
    ("lr_coupling", spec.Coupling("sqrt", base_batch_size=-1),
     r"config\.batch\.lr_coupling\.base_batch_size"),
])
def test_a_bad_override_is_refused_naming_its_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        spec.RunOverrides(**{field: value})


def test_a_batch_size_and_a_schedule_together_are_refused():
    with pytest.raises(ValueError, match="give batch_size or schedule, not both"):
        spec.RunOverrides(batch_size=8, schedule={"kind": "constant", "batch_size": 8})
    o = spec.RunOverrides(batch_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.batch_size = 16  # type: ignore[misc]


def test_trial_overrides_carry_the_trial():
    config = _sweep_config("digits_sweep")
    t = Trial(index=0, batch_size=32, learning_rate=0.02, seed=5)
    o = trials.trial_overrides(config, t)
    assert (o.batch_size, o.learning_rate, o.seed) == (32, 0.02, 5)
    assert o.max_steps == trials.step_budget(config.sweep, 32) and o.quiet
