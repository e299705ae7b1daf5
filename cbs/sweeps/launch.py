"""Runs a sweep: this shard's unfinished trials, grouped where they can share a program.

    results = cbs.sweeps.launch.run_sweep(config, sweep_dir, shard="0/4")

Trials are enumerated from `config.sweep` (`cbs.sweeps.grid.make_trials`); `shard="i/n"` keeps
indices ≡ i (mod n), so the same command serves as a Slurm array task, a Kubernetes indexed
job or a plain loop. Finished trials (records in trials.jsonl) are skipped; an unfinished one
resumes from its checkpoint. With `sweep.vmap_trials` and an in-memory dataset, the
learning rates of each (B, seed) run as one vmapped group (`cbs.sweeps.groups`) whose records
are appended together; otherwise each trial is a `cbs.engine.trainer.run` (`cbs.sweeps.trials`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import ml_collections

from cbs import data
from cbs.results.store import SweepStore, TrialResult
from cbs.sweeps.grid import Trial, make_trials, shard_trials
from cbs.sweeps.groups import TrialGroup
from cbs.sweeps.trials import run_trial_engine, summarize


def _in_memory(config: ml_collections.ConfigDict) -> bool:
    ds = data.get_dataset(config.data.name, **config.data.options)
    return ds.in_memory("train")


def pending_trials(config: ml_collections.ConfigDict, store: SweepStore,
                   shard: str | None = None) -> list[Trial]:
    """This shard's trials without a record yet, in grid order."""
    done = store.finished_ids()
    return [t for t in shard_trials(make_trials(config.sweep), shard) if t.trial_id not in done]


def run_sweep(config: ml_collections.ConfigDict, sweep_dir: str, *, shard: str | None = None,
              log: Callable[[str], Any] = print) -> list[TrialResult]:
    """Runs this shard's unfinished trials; returns their results (also in trials.jsonl)."""
    store = SweepStore(sweep_dir)
    store.write_definition({"sweep": config.sweep.to_dict(), "config": config.to_dict()})
    todo = pending_trials(config, store, shard)
    log(f"sweep {sweep_dir}: {len(todo)} trials to run"
        + (f" (shard {shard})" if shard else ""))
    results: list[TrialResult] = []
    if config.sweep.vmap_trials and todo and _in_memory(config):
        key = lambda t: (t.batch_size, t.seed)
        cache: dict = {}
        for _, group in itertools.groupby(sorted(todo, key=key), key=key):
            out = TrialGroup(config, list(group), store, cache=cache).run()
            store.append(out)
            log(summarize(out))
            results += out
    else:
        for trial in todo:
            out = run_trial_engine(config, trial, store)
            store.append([out])
            log(summarize([out]))
            results.append(out)
    store.export_csv()
    return results
