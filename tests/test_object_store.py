"""Sweeps, runs and checkpoints on a real object-store API: a GCS emulator (fake-gcs-server)
on 127.0.0.1, reached by gcsfs (records, status, leases) and by orbax's tensorstore (array
checkpoints), with concurrent writer processes.

What this proves, and what docs/scaling.md states: concurrent writers into one gs:// sweep
(or one local directory) lose no record, and each claim goes to one of them; a lease expires
once its holder stops renewing it; a sharded sweep on gs:// analyzes as the same sweep run
locally, its shards in one process, one of them killed mid-group and resumed from its gs://
checkpoint (default), or as concurrent processes (slow); a run killed with SIGKILL on gs://
resumes from its gs:// checkpoint to the uninterrupted records (slow). Every command runs on
gs:// from an empty working directory that stays empty (no local `gs:` directory), its
outputs read back from the bucket: cbs-train, cbs-sweep with its analyze step, cbs-analyze,
cbs-advise from records and from a gs:// checkpoint, cbs-compare (and --sizes), cbs-branch's
report, cbs-ramps beside the sweep (slow) and into a gs:// --out_dir, and the reference
protocol (whole-set: slow; sampled); bad gs:// input stops each in one line (exit status 2)
and writes nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import _gcs_emulator as emulator
import _warm
import fsspec
import pytest
from conftest import SUBPROCESS_XLA_FLAGS

from cbs.analysis.reports import report
from cbs.results import files, leases, paths, records, shared
from cbs.results.store import SweepStore
from cbs.runtime import checkpoint
from cbs.sweeps import groups, launch
from experiments.configs import digits_sweep

pytestmark = pytest.mark.xdist_group("object_store")  # one emulator, one worker
ROOT = Path(__file__).resolve().parent.parent
BUCKET = "cbs-test"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """gs://cbs-test on a fresh emulator; the environment points this process and its
    subprocesses at it while the module runs."""
    log = tmp_path_factory.mktemp("gcs") / "fake-gcs-server.log"
    with emulator.bucket(str(log), BUCKET) as url:
        yield url


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
                XLA_FLAGS=SUBPROCESS_XLA_FLAGS, **extra)


_WRITER = """
import os, sys, time
from cbs.results.store import SweepStore, TrialResult
sweep, w, m, sync = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]


def barrier(name):  # every writer reaches `name` before any goes on
    open(os.path.join(sync, f"{name}.{w}"), "w").close()
    while len([f for f in os.listdir(sync) if f.startswith(name + ".")]) < 4:
        time.sleep(0.01)


store = SweepStore(sweep)
barrier("start")  # all four write at once, however staggered their start-up
for j in range(m):
    i = w * m + j
    store.append([TrialResult(f"w{w}_t{j:03d}", i, 8, 0.1, 0, "done", "train/loss",
                              {"1": float(i)}, {"1": 8.0 * i}, {}, 10, 0.5, {}, 1.0)])
    held = store.claim(f"g{j:03d}")  # every writer claims every group; one may get each
    if held is not None:
        print(f"g{j:03d}", flush=True)  # kept until the process ends
barrier("end")  # and no claim is given back (at exit) before every writer has tried all
"""


@pytest.mark.parametrize("where", ["gs", "local"])
def test_four_concurrent_writers_lose_no_record_and_each_claim_has_one_holder(where, request,
                                                                               tmp_path):
    sweep = (f"{request.getfixturevalue('gcs')}/writers" if where == "gs"
             else str(tmp_path / "writers"))
    n, m = 4, 40
    start = time.perf_counter()
    sync = tmp_path / "sync"
    sync.mkdir()
    procs = [_warm.popen(["-c", _WRITER, sweep, str(w), str(m), str(sync)], env=_env())
             for w in range(n)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    got = SweepStore(sweep).records()
    assert len(got) == n * m  # every record of every writer
    assert [r["index"] for r in got] == list(range(n * m))
    claimed = [line for out, _ in outs for line in out.split()]
    assert sorted(claimed) == [f"g{j:03d}" for j in range(m)]  # each group exactly once
    print(f"{where}: {len(got)} of {n * m} records kept, {time.perf_counter() - start:.1f} s")


_ADDER = """
import os, sys, time
from cbs.results import files, records, shared
out, w, m, sync = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
open(os.path.join(sync, f"start.{w}"), "w").close()
while len(os.listdir(sync)) < 4:  # all four write at once
    time.sleep(0.01)
for j in range(m):
    shared.add_records(f"{out}/{files.RAMPS_FILE}", files.RAMP_KEYS,
                       [{"label": f"ramp {w} · seed {j}", "w": w, "j": j}])
    shared.add_records(f"{out}/{files.REFERENCE_NOISE_FILE}", files.REFERENCE_POINT_KEYS,
                       [{"step": w * m + j}])
"""


@pytest.mark.parametrize("where", ["gs", "local"])
def test_concurrent_ramp_and_noise_writers_lose_no_record(where, request, tmp_path):
    """ramps.jsonl and reference_noise.jsonl are write-once parts merged on read: four
    processes adding records at once to one directory keep every one (on an object store an
    append reads and rewrites the whole object, so concurrent appends lose records)."""
    out = (f"{request.getfixturevalue('gcs')}/studies" if where == "gs"
           else str(tmp_path / "studies"))
    n, m = 4, 6
    sync = tmp_path / "sync"
    sync.mkdir()
    procs = [_warm.popen(["-c", _ADDER, out, str(w), str(m), str(sync)], env=_env())
             for w in range(n)]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for e in errs]
    ramps_file = f"{out}/{files.RAMPS_FILE}"
    got = shared.read_merged(ramps_file, files.RAMP_KEYS)
    assert sorted((r["w"], r["j"]) for r in got) == [(w, j) for w in range(n) for j in range(m)]
    noise_file = f"{out}/{files.REFERENCE_NOISE_FILE}"
    steps = sorted(r["step"] for r in shared.read_merged(noise_file, files.REFERENCE_POINT_KEYS))
    assert steps == list(range(n * m))
    shared.export_parts(ramps_file, files.RAMP_KEYS)  # the export: every record, as before
    assert sorted(r["label"] for r in records.read_records(ramps_file)) == sorted(
        r["label"] for r in got)
    assert report.read_ramps(out) == got  # what the report reads


def test_a_lease_expires_when_its_holder_stops_renewing(gcs, monkeypatch):
    lock_dir = f"{gcs}/lease/locks"
    monkeypatch.setenv("CBS_LEASE_SECONDS", "2")
    first = leases.claim(lock_dir, "g")
    assert first is not None and first.path.endswith("g.0.lease")
    assert leases.claim(lock_dir, "g") is None  # held (and renewed)
    time.sleep(2.5)
    assert leases.claim(lock_dir, "g") is None  # still renewed by its thread
    first.stop.set()  # the holder dies without releasing: no more renewals
    first.thread.join()
    time.sleep(2.5)
    second = leases.claim(lock_dir, "g")
    assert second is not None and second.path.endswith("g.1.lease")  # taken over
    assert paths.listdir(lock_dir) == ["g.1.lease"]  # the dead lease is gone
    leases.release(second)
    assert leases.names(lock_dir) == [] and paths.listdir(lock_dir) == []
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    lease = {"host": os.uname().nodename, "pid": int(dead.stdout), "expires": time.time() + 600}
    assert paths.create_new(f"{lock_dir}/h.0.lease", json.dumps(lease).encode())
    third = leases.claim(lock_dir, "h")  # a dead process of this host holds nothing
    assert third is not None
    leases.release(third)


_SWEEP = {"batch_sizes": "8,32", "lr_factors": "1.0", "max_steps": "16",
          "evals_per_trial": "3"}  # two tiny trials (no curvature: `_sweep_args`)


def _sweep_args(sweep_dir: str, shard: str | None = None) -> list[str]:
    return [sys.executable, "-m", "experiments.sweep",
            f"--config={ROOT / 'experiments/configs/digits_sweep.py'}:tiny",
            f"--sweep_dir={sweep_dir}", "--noanalyze", "--config.train.progress_bar=False",
            *(f"--config.sweep.{k}={v}" for k, v in _SWEEP.items()),
            "--config.noise.curvature=False",
            *([f"--shard={shard}"] if shard else [])]


def _plain(sweep_dir: str) -> dict[str, dict]:
    return {r["trial_id"]: {k: v for k, v in r.items() if k != "seconds"}
            for r in SweepStore(sweep_dir).records()}


@pytest.mark.slow  # three processes; test_shards_into_a_gs_sweep_... is the fast form
def test_concurrent_shards_into_one_gs_sweep_analyze_as_the_local_sweep(gcs, tmp_path):
    sweep, local = f"{gcs}/sharded", str(tmp_path / "local")
    start = time.perf_counter()
    procs = [subprocess.Popen(args, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
             for args in (_sweep_args(sweep, "0/2"), _sweep_args(sweep, "1/2"),
                          _sweep_args(local))]  # the same sweep, unsharded, on local disk
    errors = [p.communicate(timeout=400)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-3000:] for e in errors]
    seconds = time.perf_counter() - start
    assert len(_plain(local)) == 2 and _plain(sweep) == _plain(local)
    assert len(shared.part_paths(paths.join(sweep, files.TRIALS_FILE))) == 2  # one a shard
    assert _analysis(sweep) == _analysis(local)
    print(f"two shards on gs:// and the local sweep: {seconds:.1f} s")


def _analysis(sweep_dir: str) -> str:
    """The analysis of a sweep, as JSON (NaN compares equal), without its directory."""
    out = report.analyze(sweep_dir, bootstrap=0, write=False)
    return json.dumps({k: v for k, v in out.items() if k in ("targets", "power_law", "statuses",
                                                              "num_trials", "seeds")},
                      sort_keys=True, default=str)


def _config():
    """The config of `_SWEEP`, in process."""
    c = digits_sweep.get_config("tiny")
    s = c.sweep
    s.batch_sizes, s.lr_factors, s.max_steps, s.evals_per_trial = (8, 32), (1.0,), 16, 3
    c.noise.curvature = False
    c.train.progress_bar = False
    return c


class _Killed(BaseException):
    """A kill in the middle of a group (no handler of the loop catches it)."""


def test_shards_into_a_gs_sweep_killed_and_resumed_analyze_as_the_local_sweep(
        gcs, tmp_path, monkeypatch):
    """The same in one process (fast): the shards one after the other, one of them killed
    once its group has a checkpoint on gs:// and run again, which restores it from there."""
    c = _config()
    sweep, local = f"{gcs}/inprocess", str(tmp_path / "local")
    launch.run_sweep(c, sweep, shard="1/2", log=lambda _: None)
    evaluate, save = groups.TrialGroup._evaluate, checkpoint.Checkpointer.save
    saves: list[int] = []

    def killed_after_a_checkpoint(self, *args):
        if not saves:  # no save started yet: nothing to be killed after
            return evaluate(self, *args)
        deadline = time.time() + 60  # saves are asynchronous: wait for the first to show
        while time.time() < deadline:
            if any(n.isdigit() for n in paths.listdir(f"{self.workdir}/checkpoints")):
                raise _Killed
            time.sleep(0.2)
        raise AssertionError(f"checkpoint {saves[0]} did not show on gs:// within 60 s")

    monkeypatch.setattr(checkpoint.Checkpointer, "save", lambda self, step, *a, **k: (
        saves.append(step), save(self, step, *a, **k))[1])
    monkeypatch.setattr(groups.TrialGroup, "_evaluate", killed_after_a_checkpoint)
    with pytest.raises(_Killed):
        launch.run_sweep(c, sweep, shard="0/2", log=lambda _: None)
    monkeypatch.setattr(groups.TrialGroup, "_evaluate", evaluate)
    monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
    assert saves and len(_plain(sweep)) == 1  # shard 1's trial; shard 0's was killed
    restores = []
    restore = checkpoint.Checkpointer.restore
    monkeypatch.setattr(checkpoint.Checkpointer, "restore", lambda self, *a, **k: (
        restores.append(a[0]), restore(self, *a, **k))[1])
    launch.run_sweep(c, sweep, shard="0/2", log=lambda _: None)
    assert restores and restores[0] > 0  # resumed from its gs:// checkpoint
    launch.run_sweep(c, local, log=lambda _: None)
    assert len(_plain(local)) == 2 and _plain(sweep) == _plain(local)
    assert _analysis(sweep) == _analysis(local)
    assert launch.run_sweep(c, sweep, log=lambda _: None) == []  # all finished: read back


@pytest.mark.slow  # three processes; the killed and resumed shard above is the fast form
def test_a_run_killed_on_gs_resumes_from_its_gs_checkpoint(gcs, tmp_path):
    workdir = f"{gcs}/killed"
    args = [sys.executable, "-m", "experiments.main",
            f"--config={ROOT / 'experiments/configs/digits_mlp.py'}:tiny",
            "--config.train.max_steps=40", "--config.train.checkpoint_every=10",
            "--config.train.progress_bar=False", "--config.train.tensorboard=False"]
    proc = subprocess.Popen(args + [f"--workdir={workdir}"], env=_env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    full = subprocess.Popen(args + [f"--workdir={tmp_path / 'full'}"], env=_env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ckpts = f"{workdir}/checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if any(n.isdigit() and int(n) >= 20 for n in paths.listdir(ckpts)):
            break  # checkpoint 10 is whole: orbax finishes a save before the next starts
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps = sorted(int(n) for n in paths.listdir(ckpts) if n.isdigit())
    before = records.read_json(f"{workdir}/{files.STATUS_FILE}") or {}
    assert 10 in steps and before.get("status") != "finished", (steps, before)
    rerun = subprocess.Popen(args + [f"--workdir={workdir}"], env=_env(), cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    started = None  # status.json says "running" at the step it restored, until it finishes
    while rerun.poll() is None and started is None:
        status = records.read_json(f"{workdir}/{files.STATUS_FILE}") or {}
        if status.get("status") == "running" and status["step"] != before.get("step"):
            started = status["step"]
        time.sleep(0.05)
    assert rerun.wait(timeout=300) == 0, rerun.stderr.read()[-3000:]
    assert started in steps and started >= 10  # resumed from a gs:// checkpoint
    assert full.wait(timeout=300) == 0, full.stderr.read()[-3000:]  # uninterrupted, local
    strip = lambda recs: [{k: v for k, v in r.items() if not k.startswith("perf/")
                           and k not in ("time", "seconds")} for r in recs]
    assert strip(records.read_records(f"{workdir}/{files.METRICS_FILE}")) == strip(
        records.read_records(str(tmp_path / "full" / files.METRICS_FILE)))
    assert records.read_json(f"{workdir}/{files.STATUS_FILE}")["status"] == "finished"


# Every command on gs://: committed studies' records copied to the store (not their reports,
# figures or analysis.json, which the commands write), each command run in a fresh working
# directory that must stay empty (a path handled as local would leave `gs:` there).
_STUDIES = {"digits": ("trials.jsonl", "sweep.json", "reference_noise.jsonl",
                       "reference_seeds/seed_0.jsonl", "reference_seeds/seed_1.jsonl",
                       "reference_seeds/seed_2.jsonl"),
            "digits_sgd": ("trials.jsonl", "sweep.json", "reference_noise.jsonl",
                           "reference_seeds/seed_0.jsonl", "reference_seeds/seed_1.jsonl",
                           "reference_seeds/seed_2.jsonl"),
            "digits_branch": ("branch.json", "branches.jsonl", "reference_noise.jsonl",
                              "reference/config.json", "reference/metrics.jsonl",
                              "reference/status.json"),
            **{f"shakespeare_kaplan{size}": ("trials.jsonl", "sweep.json")
               for size in ("_d32", "", "_d128")}}  # model sizes of one experiment


# the sweep of digits_ramps.py:tiny at two batch sizes and one rate (with its ramps beside it)
_RAMPS_SWEEP = (f"--config={ROOT / 'experiments/configs/digits_ramps.py'}:tiny",
                "--config.sweep.batch_sizes=8,32", "--config.sweep.lr_factors=1.0",
                "--config.noise.curvature=False", "--config.train.progress_bar=False")


@pytest.fixture(scope="module")
def studies(gcs):
    """gs://cbs-test/studies/<name>: the records of six committed studies."""
    for name, names in _STUDIES.items():
        for file in names:
            records.write_atomic(f"{gcs}/studies/{name}/{file}",
                                 (ROOT / "results" / name / file).read_bytes())
    return f"{gcs}/studies"


def _command(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m experiments.<module> args` in `cwd`, which must stay empty; no Python log
    line below WARNING reaches stderr (gcsfs logs every read of an object at INFO; the line
    tensorstore writes for the emulator's test token is no Python log)."""
    proc = _warm.python(["-m", f"experiments.{module}", *args], cwd=cwd, env=_env())
    assert sorted(os.listdir(cwd)) == [], f"{module} wrote to the local disk"
    assert not re.search(r"^I\d{4} .*\.py:\d+\]", proc.stderr, re.M), proc.stderr[-2000:]
    return proc


def _objects(root: str) -> list[str]:
    """Every object under `root`, as the store lists it now."""
    fs, bare = fsspec.core.url_to_fs(root)
    fs.invalidate_cache()
    return sorted(fs.find(bare))


def _png(path: str) -> bool:
    return (paths.read_bytes(path) or b"")[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def swept(gcs, tmp_path_factory):
    """gs://cbs-test/swept: a tiny sweep of two batch sizes run by `cbs-sweep` with its
    analyze step, from an empty working directory; (sweep directory, the command's output)."""
    sweep = f"{gcs}/swept"
    proc = _command("sweep", *_RAMPS_SWEEP, f"--sweep_dir={sweep}", "--bootstrap=20",
                    cwd=tmp_path_factory.mktemp("cwd"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep, proc.stdout


def test_sweep_on_gs_analyzes_there(swept):
    """cbs-sweep with its sweep_dir on gs:// trains the trials and then writes the report,
    its figures and analysis.json there (read back from the store)."""
    sweep, stdout = swept
    assert stdout.rstrip().splitlines()[-1].startswith(f"report: {sweep}/{files.REPORT_FILE}")
    analysis = report.load_analysis(sweep)
    assert analysis["num_trials"] == len(SweepStore(sweep).records()) == 2
    figures = paths.listdir(f"{sweep}/{files.FIGURES_DIR}")
    assert figures and all(_png(f"{sweep}/{files.FIGURES_DIR}/{f}") for f in figures)
    text = paths.read_text(f"{sweep}/{files.REPORT_FILE}")
    assert all(f"]({files.FIGURES_DIR}/{f})" in text for f in figures)


def test_analyze_writes_report_figures_and_analysis_on_gs(studies, tmp_path):
    sweep, local = f"{studies}/digits", tmp_path / "local"
    (tmp_path / "cwd").mkdir()
    proc = _command("analyze", f"--sweep_dir={sweep}", "--bootstrap=20", cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith(f"report: {sweep}/{files.REPORT_FILE}")
    analysis = report.load_analysis(sweep)  # read back from gs://
    committed = json.loads((ROOT / "results" / "digits" / files.ANALYSIS_FILE).read_text())
    assert [t["target"] for t in analysis["targets"]] == [
        t["target"] for t in committed["targets"]]
    figures = paths.listdir(f"{sweep}/{files.FIGURES_DIR}")
    assert figures == ["b_crit_vs_loss.png", "collapse.png", "noise_scale.png", "pareto.png"]
    assert all(_png(f"{sweep}/{files.FIGURES_DIR}/{f}") for f in figures)
    text = paths.read_text(f"{sweep}/{files.REPORT_FILE}")
    assert all(f"]({files.FIGURES_DIR}/{f})" in text for f in figures)  # relative links
    local.mkdir()
    for file in _STUDIES["digits"]:  # the same records on the local disk analyze alike
        (local / file).parent.mkdir(exist_ok=True)
        (local / file).write_bytes((ROOT / "results" / "digits" / file).read_bytes())
    assert _analysis(sweep) == _analysis(str(local))


@pytest.mark.parametrize("source", ["sweep_dir", "workdir"])
def test_advise_reads_and_writes_on_gs(studies, source, tmp_path):
    where = (f"{studies}/digits" if source == "sweep_dir"
             else f"{studies}/digits_branch/reference")
    name = "prediction" if source == "sweep_dir" else "advice"
    out = f"{studies}/advice_{source}"
    (tmp_path / "cwd").mkdir()
    proc = _command("advise", f"--{source}={where}", f"--out={out}", cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert paths.listdir(out) == [f"{name}.json", f"{name}.md", f"{name}.png"]
    advices = records.read_json(f"{out}/{name}.json")["advice"]
    assert advices and f"`{where}`" in paths.read_text(f"{out}/{name}.md")
    assert _png(f"{out}/{name}.png")
    assert f"{advices[-1]['b_crit']:.3g}" in proc.stdout


@pytest.fixture(scope="module")
def trained(gcs, tmp_path_factory):
    """gs://cbs-test/trained: a tiny run trained there (`cbs-train`), checkpoints at 10 and
    20; the command wrote nothing to its empty working directory."""
    workdir = f"{gcs}/trained"
    proc = _command("main", f"--config={ROOT / 'experiments/configs/digits_mlp.py'}:tiny",
                    f"--workdir={workdir}", "--config.train.max_steps=20",
                    "--config.train.checkpoint_every=10", "--config.train.progress_bar=False",
                    "--config.train.tensorboard=False", cwd=tmp_path_factory.mktemp("cwd"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert records.read_json(f"{workdir}/{files.STATUS_FILE}")["status"] == "finished"
    return workdir


@pytest.mark.parametrize("how", ["checkpoint", "step"])
def test_advise_measures_at_a_gs_checkpoint_and_writes_on_gs(trained, how, tmp_path):
    """--checkpoint=gs://RUN/checkpoints/STEP (or --workdir=gs://RUN --step=STEP) restores the
    state from the store, measures the noise scale there on the training examples and writes
    advice_STEP.md and .json to a gs:// --out."""
    step = 20 if how == "checkpoint" else 10
    where = ([f"--checkpoint={trained}/checkpoints/{step}"] if how == "checkpoint"
             else [f"--workdir={trained}", f"--step={step}"])
    out = f"{trained}_advice_{how}"
    (tmp_path / "cwd").mkdir()
    proc = _command("advise", *where, f"--out={out}", cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert paths.listdir(out) == [f"advice_{step}.json", f"advice_{step}.md"]
    got = records.read_json(f"{out}/advice_{step}.json")
    measured = got["measured"]
    assert measured["step"] == step and measured["method"] == "full_data"
    assert measured["examples"] == measured["num_train"] == 1438
    assert measured["noise/b_simple"] > 0 and got["advice"]["b_crit"] > 0
    text = paths.read_text(f"{out}/advice_{step}.md")
    assert f"`{trained}` at checkpoint {step}" in text
    assert f"{got['advice']['b_crit']:.3g}" in proc.stdout


def test_advise_at_a_missing_gs_checkpoint_stops_with_one_line_and_writes_nothing(
        gcs, trained, tmp_path):
    before = _objects(gcs)
    (tmp_path / "cwd").mkdir()
    proc = _command("advise", f"--checkpoint={trained}/checkpoints/15",
                    f"--out={gcs}/none_advice", cwd=tmp_path / "cwd")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: no checkpoint at step 15 in {trained}/checkpoints: it holds steps 10 and 20; "
        "ask for one of those"]
    assert _objects(gcs) == before


def test_compare_two_gs_studies_into_gs(studies, tmp_path):
    out = f"{studies}/compare"
    (tmp_path / "cwd").mkdir()
    proc = _command("compare", f"{studies}/digits", f"{studies}/digits_sgd", f"--out={out}",
                    "--bootstrap=20", cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert paths.listdir(out) == ["b_crit_vs_noise.png", "b_crit_vs_noise_per_trial.png",
                                  "calibration.json", "compare.json", files.REPORT_FILE]
    assert paths.read_text(f"{out}/{files.REPORT_FILE}") in proc.stdout  # printed as read
    assert _png(f"{out}/b_crit_vs_noise.png") and _png(f"{out}/b_crit_vs_noise_per_trial.png")


def test_compare_sizes_of_gs_studies_into_gs(studies, tmp_path):
    """--sizes: the three model sizes of the Kaplan study, read from gs://, their pooled fits
    written to gs:// as from the committed records on the local disk."""
    dirs = [f"{studies}/shakespeare_kaplan{size}" for size in ("_d32", "", "_d128")]
    out = f"{studies}/kaplan_sizes"
    (tmp_path / "cwd").mkdir()
    proc = _command("compare", "--sizes", *dirs, f"--out={out}", "--bootstrap=20",
                    cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert paths.listdir(out) == [files.SIZES_FIGURE_FILE, files.REPORT_FILE, files.SIZES_FILE]
    text = paths.read_text(f"{out}/{files.REPORT_FILE}")
    assert text in proc.stdout and f"D = 32: `{dirs[0]}`" in text
    assert f"]({files.SIZES_FIGURE_FILE})" in text and _png(f"{out}/{files.SIZES_FIGURE_FILE}")
    got = records.read_json(f"{out}/{files.SIZES_FILE}")
    assert [s["d_model"] for s in got["studies"]] == [32, 64, 128]
    assert [s["sweep_dir"] for s in got["studies"]] == dirs
    local = [str(ROOT / "results" / os.path.basename(d)) for d in dirs]
    (tmp_path / "local").mkdir()
    assert _command("compare", "--sizes", *local, f"--out={tmp_path / 'local' / 'out'}",
                    "--bootstrap=20", cwd=tmp_path / "cwd").returncode == 0
    want = json.loads((tmp_path / "local" / "out" / files.SIZES_FILE).read_text())
    assert got["result"] == want["result"]  # the same records, the same fits


def test_branch_report_from_gs_records(studies, tmp_path):
    workdir = f"{studies}/digits_branch"
    (tmp_path / "cwd").mkdir()
    proc = _command("branch", "--analyze_only", f"--workdir={workdir}",
                    f"--sweep_dir={studies}/digits", cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = paths.read_text(f"{workdir}/{files.REPORT_FILE}")
    assert "Swept B_crit" in text and text in proc.stdout
    assert _png(f"{workdir}/local_cbs.png")


@pytest.mark.slow  # trains a tiny branch study (reference run, branches, report)
def test_a_branch_study_runs_on_gs_and_reports_there(gcs, tmp_path):
    """`cbs-branch` end to end with its workdir on gs://: the trunk's checkpoints, the
    branches' records and the report land there, nothing on the local disk; a second call
    finds every unit done and trains nothing more."""
    workdir = f"{gcs}/branch"
    (tmp_path / "cwd").mkdir()
    args = (f"--config={ROOT / 'experiments/configs/digits_branch.py'}:tiny",
            f"--workdir={workdir}", "--config.train.progress_bar=False")
    proc = _command("branch", *args, cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    units = records.read_records(f"{workdir}/{files.BRANCHES_FILE}")
    assert units and all("k" in u and "point_step" in u for u in units)
    text = paths.read_text(f"{workdir}/{files.REPORT_FILE}")
    assert text and text in proc.stdout
    again = _command("branch", *args, cwd=tmp_path / "cwd")
    assert again.returncode == 0, again.stderr[-3000:]
    assert records.read_records(f"{workdir}/{files.BRANCHES_FILE}") == units


@pytest.mark.slow  # trains a sweep of two batch sizes and three ramps (~25 s)
def test_ramps_beside_a_gs_sweep_report_there(gcs, tmp_path):
    sweep = f"{gcs}/ramps"
    (tmp_path / "cwd").mkdir()
    proc = _command("ramps", f"--config={ROOT / 'experiments/configs/digits_ramps.py'}:tiny",
                    f"--sweep_dir={sweep}", "--config.sweep.batch_sizes=8,32",
                    "--config.noise.curvature=False", "--config.train.progress_bar=False",
                    cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    labels = [r["label"] for r in report.read_ramps(sweep)]
    assert sorted(labels) == ["adaptive", "fixed B=32", "step"]
    text = paths.read_text(f"{sweep}/{files.REPORT_FILE}")
    assert "## Batch-size ramps" in text and all(f"| {label} |" in text for label in labels)
    assert report.load_analysis(sweep)["num_trials"] == len(SweepStore(sweep).records())


_PAYOFF_CONFIG = """
from cbs.configs import base, digits_ramps


def get_config(arg=""):  # the sweep of digits_ramps.py:tiny; two fixed batch sizes, one seed
    c = digits_ramps.get_config(arg)
    c.ramps = base.seeded([digits_ramps.fixed(8), digits_ramps.fixed(32)], (0,))
    return c
"""


def test_ramps_into_a_gs_out_dir_beside_a_gs_sweep(swept, tmp_path):
    """--out_dir=gs://: the ramps' records, runs and payoff report go there, read back from
    the store; the sweep's directory (finished, on gs://) is only read."""
    sweep, _ = swept
    out = f"{sweep}_payoff"
    config = tmp_path / "payoff.py"
    config.write_text(_PAYOFF_CONFIG)
    before = _objects(sweep)
    (tmp_path / "cwd").mkdir()
    proc = _command("ramps", f"--config={config}:tiny", *_RAMPS_SWEEP[1:],
                    f"--sweep_dir={sweep}", f"--out_dir={out}", cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _objects(sweep) == before  # only read
    got = report.read_ramps(out)
    assert sorted(r["label"] for r in got) == ["fixed B=32 · seed 0", "fixed B=8 · seed 0"]
    text = paths.read_text(f"{out}/{files.PAYOFF_REPORT_FILE}")
    assert text in proc.stdout and f"`{sweep}`" in text
    assert _png(f"{out}/{files.PAYOFF_FIGURE_FILE}")
    assert records.read_json(f"{out}/{files.PAYOFF_FILE}")["targets"]


@pytest.mark.parametrize("protocol", [
    pytest.param("full_data", marks=pytest.mark.slow),  # 10-13 s; the sampled call is the fast one
    "sampled"])
def test_the_reference_protocol_on_a_gs_study(gcs, protocol, tmp_path):
    """`experiments.reference --sweep_dir=gs://...` on a tiny Adam study stored there: the
    seed's reference run (its run directory on gs:// too) and its record, read back; the
    sampled protocol (--examples) measures only at each target's window."""
    from cbs.analysis.studies import reference_protocol
    from cbs.sweeps import reference_seeds
    from tests.test_reference_seeds import _tiny_adam_study

    study = f"{gcs}/reference_{protocol}"
    _tiny_adam_study(study)
    sampled = ("--examples=64", "--deviations=8", "--hessian_examples=16")
    (tmp_path / "cwd").mkdir()
    proc = _command("reference", f"--sweep_dir={study}", "--seeds=1", "--evals=8",
                    *(sampled if protocol == "sampled" else ()), cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [record] = records.read_records(reference_seeds.seed_path(study, 0))
    assert (record["batch_size"], record["seed"], record["preconditioner"]) == (32, 0, "adam")
    assert record["deviations"] == (8 if protocol == "sampled" else 256)
    assert record.get("method", "full_data") == protocol
    measured = [v for v in record["curve"]["noise_p/trace_sigma"] if v is not None]
    assert measured and len(measured) < len(record["curve"]["step"])
    runs = f"{study}/{reference_seeds.SEEDS_DIR}/runs"
    assert paths.listdir(runs) == ["b000032_s0"]  # the seed's run directory, on gs:// too
    assert files.METRICS_FILE in paths.listdir(f"{runs}/b000032_s0")
    summary = reference_protocol.load(study)
    assert summary["seeds"] == [0] and reference_protocol.markdown(summary) in proc.stdout


@pytest.mark.parametrize("module,args", [
    ("analyze", ("--sweep_dir={gs}/none",)),
    ("advise", ("--workdir={gs}/none",)),
    ("advise", ("--sweep_dir={gs}/none",)),
    ("advise", ("--checkpoint={gs}/none/checkpoints",)),
    ("advise", ("--workdir={gs}/none", "--step=10", "--out={gs}/none_out")),
    ("compare", ("{gs}/none", "--out={gs}/none_out")),
    ("compare", ("{studies}/digits", "{studies}/digits_sgd",
                 "--out={studies}/digits/sweep.json")),
    ("compare", ("--sizes", "{studies}/shakespeare_kaplan", "{gs}/none", "--out={gs}/none_out")),
    ("compare", ("--sizes", "{studies}/shakespeare_kaplan", "{studies}/digits",
                 "--out={gs}/none_out")),
    ("branch", ("--analyze_only", "--workdir={gs}/none")),
    ("sweep", (*_RAMPS_SWEEP, "--sweep_dir={studies}/digits")),
    ("ramps", (*_RAMPS_SWEEP, "--sweep_dir={studies}/digits", "--out_dir={gs}/none_out")),
    ("reference", ("--sweep_dir={gs}/none", "--seeds=1")),
], ids=["analyze", "advise_workdir", "advise_sweep_dir", "advise_checkpoint", "advise_step",
        "compare", "compare_out_a_file", "compare_sizes", "compare_sizes_other_data", "branch",
        "sweep_of_another_config", "ramps_beside_another_config", "reference"])
def test_bad_gs_input_stops_with_one_line_and_writes_nothing(gcs, studies, module, args,
                                                             tmp_path):
    before = _objects(gcs)
    (tmp_path / "cwd").mkdir()
    proc = _command(module, *(a.format(gs=gcs, studies=studies) for a in args),
                    cwd=tmp_path / "cwd")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "gs://" in proc.stderr and "gs:/" not in proc.stderr.replace("gs://", "")
    assert _objects(gcs) == before
