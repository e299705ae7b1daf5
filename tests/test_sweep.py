"""The sweep grid, sharding, validation and the results store."""

import json
import os

import pytest

from cbs.results import files
from cbs.results.store import SweepStore, TrialResult
from cbs.sweeps import grid
from cbs.sweeps.grid import Trial


def _sweep(**changes):
    s = grid.default_sweep_config()
    s.update(changes)
    return s


def test_grid_centres_learning_rates_on_the_rule():
    s = _sweep(batch_sizes=(16, 64, 256), base_lr=1e-3, base_batch_size=64, lr_rule="sqrt",
               lr_factors=(0.5, 1.0, 2.0), seeds=(0, 1))
    trials = grid.make_trials(s)
    assert len(trials) == 3 * 2 * 3
    assert [t.index for t in trials] == list(range(18))
    lrs_256 = sorted({t.learning_rate for t in trials if t.batch_size == 256})
    assert lrs_256 == pytest.approx([1e-3, 2e-3, 4e-3])  # centre 1e-3·(256/64)^½ = 2e-3
    lrs_16 = sorted({t.learning_rate for t in trials if t.batch_size == 16})
    assert lrs_16 == pytest.approx([2.5e-4, 5e-4, 1e-3])
    linear = grid.learning_rates_for(_sweep(lr_rule="linear", lr_factors=(1.0,)), 128)
    assert linear == pytest.approx([2e-3])


def test_absolute_grid_and_cap():
    s = _sweep(batch_sizes=(8,), learning_rates=(0.1, 0.01), max_lr=0.05)
    assert grid.learning_rates_for(s, 8) == pytest.approx([0.01, 0.05])


def test_shards_partition_the_grid():
    trials = grid.make_trials(_sweep(batch_sizes=(8, 16, 32, 64), seeds=(0, 1)))
    shards = [grid.shard_trials(trials, f"{i}/3", (64, 8, 32, 16)) for i in range(3)]
    ids = [t.trial_id for shard in shards for t in shard]
    assert sorted(ids) == sorted(t.trial_id for t in trials)
    assert len(set(ids)) == len(ids)
    # whole batch sizes by rank: 8 and 64 (ranks 0 and 3) in shard 0, 16 in 1, 32 in 2
    assert [sorted({t.batch_size for t in s}) for s in shards] == [[8, 64], [16], [32]]
    assert len(shards[1]) == len([t for t in trials if t.batch_size == 16])
    for bad in ("3/3", "x", "1/0", "-1/2"):
        with pytest.raises(ValueError, match="shard"):
            grid.parse_shard(bad)


@pytest.mark.parametrize("field,value,match", [
    ("batch_sizes", (), "batch_sizes"),
    ("batch_sizes", (8, 8), "duplicates"),
    ("batch_sizes", (0, 8), "> 0"),
    ("lr_rule", "cubic", "lr_rule"),
    ("targets", (), "targets"),
    ("target_metric", "accuracy", "target_metric"),
    ("evals_per_trial", 1, "evals_per_trial"),
])
def test_invalid_sweeps_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=f"config.sweep.{field}.*") as err:
        grid.make_trials(_sweep(**{field: value}))
    assert match in str(err.value)


def test_no_budget_is_rejected():
    with pytest.raises(ValueError, match="budget"):
        grid.validate_sweep(_sweep(max_steps=0, max_examples=0))


def _result(trial: Trial, steps) -> TrialResult:
    return TrialResult(trial.trial_id, trial.index, trial.batch_size, trial.learning_rate,
                       trial.seed, "done", "full_train/loss", {"0.5": steps},
                       {"0.5": None if steps is None else steps * trial.batch_size},
                       {"0.5": {"b_simple": 10.0}}, 100, 0.4, {"step": [0, 1]}, 1.0)


def test_store_appends_whole_records_and_ignores_repeats_and_torn_lines(tmp_path):
    store = SweepStore(str(tmp_path))
    a, b = Trial(0, 8, 1e-3, 0), Trial(1, 16, 1e-3, 0)
    store.append([_result(a, 12.5), _result(b, None)])
    store.append([_result(a, 99.0)])  # a repeat after a crash between append and exit
    with open(store.path, "a") as f:
        f.write('{"trial_id": "torn')  # a kill in the middle of a write
    records = store.records()
    assert [r["trial_id"] for r in records] == [a.trial_id, b.trial_id]
    assert records[0]["steps_to_target"]["0.5"] == 12.5
    assert store.finished_ids() == {a.trial_id, b.trial_id}
    rows = open(store.export_csv()).read().splitlines()
    assert rows[0].startswith("trial_id,batch_size")
    assert len(rows) == 3 and ",12.5,100.0," in rows[1] and ",,," in rows[2]


def test_store_refuses_a_different_definition(tmp_path):
    store = SweepStore(str(tmp_path))
    store.write_definition({"sweep": {"batch_sizes": [8]}})
    store.write_definition({"sweep": {"batch_sizes": [8]}})  # same: fine
    with pytest.raises(ValueError, match=r"different grid: sweep.batch_sizes \(\[8\] -> \[16\]\)"):
        store.write_definition({"sweep": {"batch_sizes": [16]}})
    assert json.load(open(os.path.join(tmp_path, files.SWEEP_FILE)))["sweep"]["batch_sizes"] == [8]
