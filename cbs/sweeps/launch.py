"""Runs a sweep: this shard's unfinished trials, grouped where they can share a program.

    results = cbs.sweeps.launch.run_sweep(config, sweep_dir, shard="0/4")

The config is validated (`check_config`) before anything is written. Round after round, the
grid's trials and the rates added past edge optima at this shard's batch sizes run on a back
end of `cbs.sweeps.trials` (`sweep.vmap_trials`), finished ones skipped, unfinished ones
resumed. Each group is claimed (`SweepStore.claim`), so launchers on one directory share the
work. With `sweep.noise_protocol = "reference"`, an unsharded launch that finds every trial
finished runs the reference trajectory (`cbs.sweeps.reference`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from cbs import data, models
from cbs.engine import config as config_lib
from cbs.engine import spec
from cbs.engine.noise_spec import NoiseSpec
from cbs.results.store import SweepStore, TrialResult
from cbs.runtime import preemption
from cbs.runtime.fields import ConfigError
from cbs.runtime.writer import CountBar
from cbs.sweeps import grid
from cbs.sweeps.groups import TrialGroup, group_name
from cbs.sweeps.reference import run_reference
from cbs.sweeps.trials import run_trial_engine, summarize

__all__ = ["check_config", "group_slots", "pending_trials", "run_sweep", "sweep_definition"]


def check_config(config: ml_collections.ConfigDict) -> list[grid.Trial]:
    """Validates the whole sweep (each B's run config too) before anything runs, raising a
    ValueError that names the field; returns its base trials."""
    trials = grid.make_trials(config.sweep)
    sizes = sorted({t.batch_size for t in trials})
    if config.data.name not in data.known_datasets():
        raise ConfigError(f"config.data.name: {config.data.name!r} is not one of "
                         f"{data.known_datasets()}")
    ds = data.get_dataset(config.data.name, **config.data.options)
    n = ds.num_train
    for b in sizes:
        if b > n:
            raise ConfigError(f"config.sweep.batch_sizes: {b} is larger than the training split "
                             f"of {config.data.name} ({n} examples); use batch sizes <= {n}")
    models.abstract_model(config.model, input_shape=ds.input_shape,
                          num_classes=ds.num_classes if ds.task != "regression" else None,
                          vocab_size=ds.vocab_size, seed=config.seed)
    noise = NoiseSpec.of(config)
    if config.sweep.get("noise_protocol") == "reference":
        NoiseSpec.of(config, "reference")  # its fields checked before anything trains
    if noise.examples == "stream" and noise.batch_size > n:
        raise ConfigError(f"config.noise.batch_size: {noise.batch_size} is larger than the "
                          f"training split ({n} examples)")
    for b in sizes:
        c = spec.run_config(config, spec.RunOverrides(
            batch_size=b, micro_batch=b, learning_rate=trials[0].learning_rate,
            noise_every=0))
        config_lib.validate(c, data_replicas=1, model_names=models.model_names(),
                            dataset_names=data.known_datasets())
    return trials


def sweep_definition(config: ml_collections.ConfigDict, base: list[grid.Trial]) -> dict[str, Any]:
    """sweep.json: the config over every default (engine, model, sweep; less the sections of
    studies that read a sweep), its sweep section, the base grid and N."""
    defaults = config_lib.default_config().to_dict()
    if config.get("model") and config.model.get("name") in models.model_names():
        defaults["model"] = models.default_model_config(config.model.name).to_dict()
    defaults["sweep"] = grid.default_sweep_config().to_dict()
    resolved = _merge(defaults, config.to_dict())
    for key in ("ramps", "branch"):
        resolved.pop(key, None)
    ds = data.get_dataset(config.data.name, **config.data.options)
    return {"sweep": resolved["sweep"], "config": resolved, "trials": grid.trial_table(base),
            "num_train": ds.num_train}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def pending_trials(config: ml_collections.ConfigDict, store: SweepStore,
                   shard: str | None = None) -> list[grid.Trial]:
    """This shard's trials without a record yet, in grid order (extensions included)."""
    records = store.records()
    done = {r["trial_id"] for r in records}
    trials = grid.grid_trials(config.sweep, records)
    return [t for t in grid.shard_trials(trials, shard, config.sweep.batch_sizes)
            if t.trial_id not in done]


def run_sweep(config: ml_collections.ConfigDict, sweep_dir: str, *, shard: str | None = None,
              redefine: bool = False, log: Callable[[str], Any] = print) -> list[TrialResult]:
    """Runs this shard's unfinished trials (module docstring); returns their results.
    `redefine`: accept a grid that differs from sweep_dir's (`SweepStore.write_definition`)."""
    base = check_config(config)
    grid.parse_shard(shard)
    store = SweepStore(sweep_dir)
    store.write_definition(sweep_definition(config, base), redefine=redefine)
    vmap = config.sweep.vmap_trials and data.get_dataset(
        config.data.name, **config.data.options).in_memory("train")
    results: list[TrialResult] = []
    cache: dict = {}
    stuck = None
    for round_ in itertools.count():
        todo = pending_trials(config, store, shard)
        ids = [t.trial_id for t in todo]
        if not todo or ids == stuck:
            break
        log(f"sweep {sweep_dir}: {len(todo)} trials to run"
            + (f" (shard {shard})" if shard else "") + (f", round {round_}" if round_ else ""))
        ran = _run_claimed(config, store, todo, vmap, cache, log)
        results += ran
        waited = False  # until no other process holds a group of this sweep
        for name in store.claim_names():
            held = store.claim(name)
            if held is None:
                waited, held = True, store.claim(name, wait=True)
            if held is not None:
                store.release(held)  # a waiting claim returns it
        stuck = None if ran or waited else ids  # nothing could move: stop, do not spin
    waiting = [t for t in pending_trials(config, store)
               if t not in grid.shard_trials([t], shard, config.sweep.batch_sizes)]
    if waiting:
        log(f"{len(waiting)} trials of other shards are unfinished; run those shards before "
            "the analysis")
    elif config.sweep.get("noise_protocol", "per_trial") == "reference" and shard is None:
        run_reference(config, store, log=log)
    store.export()
    return results


def group_slots(config: ml_collections.ConfigDict, group: list[grid.Trial]) -> list[grid.Trial]:
    """The trials a vmapped group runs: for base-grid trials, every base trial at their
    (B, seed) (the group an uninterrupted sweep ran, so a rerun of some of them gives
    bit-identical records; the finished ones are dropped); added trials as they are."""
    t = group[0]
    base = [b for b in grid.make_trials(config.sweep)
            if (b.batch_size, b.seed) == (t.batch_size, t.seed)]
    ids = {b.trial_id for b in base}
    return base if all(g.trial_id in ids for g in group) else group


def _run_claimed(config, store, todo, vmap, cache, log) -> list[TrialResult]:
    """Runs each group this process can claim; skips those another process is running."""
    results: list[TrialResult] = []
    key = lambda t: (t.batch_size, t.seed) if vmap else t.index
    enabled = bool(config.train.progress_bar) and jax.process_index() == 0
    with CountBar(len(todo), unit="trial", enabled=enabled, log=log) as bar:
        for _, grouped in itertools.groupby(sorted(todo, key=key), key=key):
            group = list(grouped)
            slots = group_slots(config, group) if vmap else group
            preemption.check(f"before {group_name(slots)}")  # finished groups are recorded
            held = store.claim(group_name(slots))
            if held is None:
                bar.log(f"{group_name(slots)}: running in another process")
                continue
            try:
                done = store.finished_ids()
                group = [t for t in group if t.trial_id not in done]  # finished meanwhile
                if not group:
                    continue
                if vmap:  # the group's original slots: a rerun of some is bit-identical
                    wanted = {t.trial_id for t in group}
                    out = [r for r in TrialGroup(config, slots, store, cache=cache).run()
                           if r.trial_id in wanted]
                else:
                    out = [run_trial_engine(config, group[0], store)]
                store.append(out)
                bar.log(summarize(out))
                bar.update(len(out))
                results += out
            finally:
                store.release(held)
    return results
