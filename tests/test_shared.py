"""cbs.results.shared: records files that several processes add to, at scale.

On the GCS emulator (fake-gcs-server on 127.0.0.1, which logs every request it answers): a
sweep of n trials, written as a launcher writes it (claim, finished ids, one part, release,
per trial) and analyzed, costs a number of requests linear in n (counted, with the ratio of
two sizes); compaction keeps every record that writers and other compactions add meanwhile,
and readers see every record while parts are compacted under them. Locally parts are never
compacted on their own, and an explicit compaction keeps what was written meanwhile.
"""

from __future__ import annotations

import json
import math
import threading
import time

import _gcs_emulator as emulator
import pytest

from cbs.analysis.reports import report
from cbs.results import files, paths, shared
from cbs.results.store import SweepStore, TrialResult

pytestmark = pytest.mark.xdist_group("object_store")  # one emulator, one worker
BUCKET = "cbs-shared"
REQUESTS_PER_TRIAL = 12  # c in requests <= c·n (claim 2, read 2, write 3, release 1,
#                          compactions about 2.2)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """(gs://cbs-shared, the emulator's request log) on a fresh emulator that logs every
    request; the environment points this process at it while the module runs."""
    log = str(tmp_path_factory.mktemp("gcs") / "fake-gcs-server.log")
    with emulator.bucket(log, BUCKET, count=True) as url:
        yield url, log


def _count(log: str) -> int:
    """Requests the emulator has logged, once its log has stopped growing."""
    count = -1
    while (now := len(emulator.requests(log))) != count:
        count = now
        time.sleep(0.2)
    return count


def _result(i: int) -> TrialResult:
    """Trial i of a synthetic sweep: ten batch sizes, four learning rates, seeds after that;
    steps to the one target follow S = S_min(1 + B_crit/B), slower away from the best rate."""
    b, lr, seed = 8 * 2 ** (i % 10), 0.1 * 2.0 ** ((i // 10) % 4 - 2), i // 40
    steps = 200 * (1 + 256 / b) * (1 + 0.3 * abs(math.log2(lr / 0.1))) * (1 + 0.01 * seed)
    return TrialResult(f"b{b:06d}_lr{lr:.4e}_s{seed}", i, b, lr, seed, "done", "train/loss",
                       {"1": steps}, {"1": steps * b}, {"1": {"b_simple": 200.0}},
                       int(steps) + 1, 0.9, {}, 0.1)


def _sweep(sweep_dir: str, n: int) -> dict:
    """Writes n trials as a launcher does (`cbs.sweeps.launch`: per trial a claim, the
    finished ids, one part, the release), exports, and analyzes the sweep."""
    store = SweepStore(sweep_dir)
    for i in range(n):
        result = _result(i)
        held = store.claim(f"t{i}")
        assert held is not None
        assert result.trial_id not in store.finished_ids()
        store.append([result])
        store.release(held)
    store.export()
    return report.analyze(sweep_dir, bootstrap=0, write=False)


def _sweep_requests(root: str, log: str, n: int) -> int:
    before = _count(log)
    start = time.perf_counter()
    analysis = _sweep(f"{root}/sweep{n}", n)
    used = _count(log) - before
    assert analysis["num_trials"] == n
    folder = paths.listdir(shared.parts_dir(f"{root}/sweep{n}/{files.TRIALS_FILE}"))
    print(f"n={n}: {used} requests ({used / n:.2f} a trial), {len(folder)} parts left, "
          f"{time.perf_counter() - start:.1f} s")
    return used


def _linear(emulated, small: int, large: int) -> None:
    root, log = emulated
    counts = {n: _sweep_requests(root, log, n) for n in (small, large)}
    for n, used in counts.items():
        assert used <= REQUESTS_PER_TRIAL * n, (n, used)
    ratio = counts[large] / counts[small]
    assert abs(ratio / (large / small) - 1) < 0.1, counts  # linear, not n log n or n²


def test_a_gs_sweep_costs_requests_linear_in_its_trials(emulated):
    _linear(emulated, 300, 600)


@pytest.mark.slow  # 85 s on two busy CPU cores (22,543 requests); 300/600 above is the fast form
def test_a_gs_sweep_of_2000_trials_costs_requests_linear_in_its_trials(emulated):
    _linear(emulated, 500, 2000)


def test_add_records_on_gs_costs_requests_linear_in_the_records(emulated):
    """add_records (ramps, reference noise) writes its part only: the export is written once,
    by the command, at its end."""
    root, log = emulated
    counts = {}
    for n in (150, 300):
        path = f"{root}/added{n}/{files.RAMPS_FILE}"
        before = _count(log)
        for i in range(n):
            shared.add_records(path, files.RAMP_KEYS, [{"label": f"run {i}", "i": i}])
        shared.export_parts(path, files.RAMP_KEYS)
        counts[n] = _count(log) - before
        assert [r["i"] for r in shared.read_merged(path, files.RAMP_KEYS)] == list(range(n))
        assert len(paths.read_bytes(path).splitlines()) == n  # the export
    assert counts[150] <= 6 * 150 and counts[300] <= 6 * 300, counts
    assert abs(counts[300] / counts[150] / 2 - 1) < 0.1, counts


def _part(path: str, i: int) -> str:
    return shared.write_part(path, shared.part_name([f"r{i}"]), [{"key": i}])


def test_a_compaction_keeps_the_parts_written_meanwhile(emulated):
    path = f"{emulated[0]}/meanwhile/{files.TRIALS_FILE}"
    for i in range(shared.FANOUT - 4):  # with the late ones, one short of a compaction
        _part(path, i)
    listed = shared.part_paths(path)
    late = [_part(path, i) for i in range(100, 103)]  # written after the compactor listed
    new = shared.compact(path, listed)
    now = shared.part_paths(path)
    assert sorted(now) == sorted([new, *late])  # the late parts stay
    assert shared.part_level(new) == 1 and not set(listed) & set(now)
    got = [r["key"] for r in shared.read_merged(path, ("key",))]
    assert sorted(got) == [*range(shared.FANOUT - 4), 100, 101, 102]
    assert shared.compact(path, listed) is None  # compacted already: nothing to read


def test_concurrent_writers_compactors_and_readers_lose_nothing(emulated):
    """Two writers add 120 records each (their own compactions included) while a third thread
    compacts whatever level-0 parts it lists and a fourth reads: every record stays, and no
    read ever sees fewer records than an earlier one."""
    path = f"{emulated[0]}/race/{files.TRIALS_FILE}"
    n, done, errors, seen = 120, threading.Event(), [], [0]

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - reported by the test
                errors.append(err)
        return threading.Thread(target=run)

    def write(w):
        for i in range(n):
            _part(path, w * 1000 + i)

    def compact_all():
        while not done.is_set():
            level0 = [p for p in shared.part_paths(path)
                      if shared.part_level(p) == 0 and not p.endswith(shared.LEGACY_PART)]
            if len(level0) > 1:
                shared.compact(path, level0)

    def read():
        while not done.is_set():
            got = len(shared.read_merged(path, ("key",)))
            assert got >= seen[0], f"a read saw {got} records after one saw {seen[0]}"
            seen[0] = got

    writers = [guard(lambda w=w: write(w)) for w in range(2)]
    others = [guard(compact_all), guard(read)]
    for t in writers + others:
        t.start()
    for t in writers:
        t.join()
    done.set()
    for t in others:
        t.join()
    assert not errors, errors
    got = shared.read_merged(path, ("key",))
    assert sorted(r["key"] for r in got) == sorted(w * 1000 + i for w in range(2)
                                                   for i in range(n))
    assert len(shared.part_paths(path)) < n  # compacted
    print(f"{len(shared.part_paths(path))} parts for {2 * n} records; reads saw up to {seen[0]}")


def test_a_reader_lists_again_when_a_compaction_deletes_what_it_listed(emulated, monkeypatch):
    path = f"{emulated[0]}/relist/{files.TRIALS_FILE}"
    for i in range(5):
        _part(path, i)
    stale = paths.listdir_versions(shared.parts_dir(path))
    shared.compact(path, shared.part_paths(path))  # between the reader's listing and its read
    listings = []
    fresh = paths.listdir_versions
    monkeypatch.setattr(paths, "listdir_versions", lambda p: (
        listings.append(p), stale if len(listings) == 1 else fresh(p))[1])
    assert [r["key"] for r in shared.read_merged(path, ("key",))] == list(range(5))
    assert len(listings) == 2


def test_a_store_fetches_each_part_once(emulated):
    root, log = emulated
    store = SweepStore(f"{root}/cached")
    for i in range(3):
        store.append([_result(i)])
    assert len(store.records()) == 3
    before = _count(log)
    assert len(store.records()) == 3
    assert _count(log) - before == 1  # the listing only
    store.append([_result(3)])
    before = _count(log)
    assert len(store.records()) == 4
    assert _count(log) - before == 2  # the listing and the new part


def test_local_parts_are_not_compacted_on_their_own(tmp_path):
    path = str(tmp_path / files.TRIALS_FILE)
    for i in range(shared.FANOUT + 3):
        _part(path, i)
    assert len(shared.part_paths(path)) == shared.FANOUT + 3
    listed, rest = shared.part_paths(path)[:shared.FANOUT], shared.part_paths(path)[shared.FANOUT:]
    late = _part(path, 99)
    new = shared.compact(path, listed)  # explicitly: the same rules as on a store
    assert sorted(shared.part_paths(path)) == sorted([new, *rest, late])
    assert sorted(r["key"] for r in shared.read_merged(path, ("key",))) == [
        *range(shared.FANOUT + 3), 99]
    with open(new) as f:
        assert json.loads(f.readline())["key"] == 0  # the first part's record first
