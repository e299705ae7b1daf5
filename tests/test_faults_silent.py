"""Faults that would otherwise give silently wrong answers: a sweep directory reused with a
different config, estimators given models they cannot measure, configs that fail after
writing, resumes that are not bit-identical, a full disk. Each test asserts a one-line
refusal (or the identical result) and that nothing is left half-written."""

from __future__ import annotations

import errno
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import _warm
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SUBPROCESS_XLA_FLAGS
from flax import nnx

from cbs.engine import loop, trainer
from cbs.results import records, shared
from cbs.results.store import SweepStore, definition_diff
from cbs.runtime import checkpoint, cli
from cbs.runtime import mesh as mesh_lib
from cbs.stats import dropin, ghost, loss_checks, noise
from cbs.sweeps import branches, grid, launch, ramps
from experiments.configs import digits_branch, digits_mlp, digits_ramps, digits_sweep

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _quiet(_):
    pass


def _subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != cli.VERBOSE_ENV}
    return env | {"XLA_FLAGS": SUBPROCESS_XLA_FLAGS, "PYTHONPATH": str(ROOT),
                  "JAX_PLATFORMS": "cpu"}


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------- 1. a sweep directory knows what it holds

def _defined(tmp_path, config) -> str:
    d = str(tmp_path / "sweep")
    SweepStore(d).write_definition(launch.sweep_definition(config, launch.check_config(config)))
    return d


def test_a_sweep_directory_refuses_another_model_or_optimizer_even_with_redefine(tmp_path):
    d = _defined(tmp_path, digits_sweep.get_config("tiny"))
    before = (tmp_path / "sweep" / "sweep.json").read_text()
    other = digits_sweep.get_config("tiny")
    other.model.hidden_sizes, other.optim.name = (16,), "sgd"
    other.sweep.batch_sizes = (8, 32)
    for redefine in (False, True):
        with pytest.raises(ValueError) as err:
            launch.run_sweep(other, d, redefine=redefine, log=_quiet)
        assert _one_line(err).endswith(
            'different config: model.hidden_sizes ([128, 128] -> [16]), optim.name ("adam" -> '
            '"sgd"); rerun with the original values, or use a new --sweep_dir')
    assert (tmp_path / "sweep" / "sweep.json").read_text() == before
    same = digits_sweep.get_config("tiny")  # output-only fields are not part of the definition
    same.train.progress_bar, same.sweep.checkpoint_every_evals = False, 5
    launch.sweep_definition(same, launch.check_config(same))
    SweepStore(d).write_definition(launch.sweep_definition(same, launch.check_config(same)))
    assert (tmp_path / "sweep" / "sweep.json").read_text() == before


def test_redefine_changes_only_the_grid_and_rewrites_sweep_json_to_what_trains(tmp_path):
    d = _defined(tmp_path, digits_sweep.get_config("tiny"))
    bigger = digits_sweep.get_config("tiny")
    bigger.sweep.batch_sizes = (8, 32, 128, 256)
    definition = launch.sweep_definition(bigger, launch.check_config(bigger))
    with pytest.raises(ValueError, match=r"different grid: sweep.batch_sizes \(\[8, 32, 128\] "
                                         r"-> \[8, 32, 128, 256\]\); .*pass --redefine"):
        SweepStore(d).write_definition(definition)
    SweepStore(d).write_definition(definition, redefine=True)
    stored = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert stored["config"]["sweep"]["batch_sizes"] == [8, 32, 128, 256]
    assert stored["config"]["model"]["hidden_sizes"] == [128, 128]
    assert stored["config"]["optim"]["b2"] == 0.999  # defaults are stored too
    assert sorted({t["batch_size"] for t in stored["trials"]}) == [8, 32, 128, 256]


@pytest.mark.parametrize("name,module", [("digits", "digits_sweep"),
                                         ("digits_sgd", "digits_sgd_sweep"),
                                         ("shakespeare_kaplan", "shakespeare_kaplan"),
                                         ("shakespeare_char", "shakespeare_sweep")])
def test_committed_studies_written_by_older_code_resume_with_nothing_to_run(tmp_path, name,
                                                                             module):
    d = tmp_path / name
    d.mkdir()
    for f in ("sweep.json", "trials.jsonl", "reference_noise.jsonl"):  # the reference run too
        if (ROOT / "results" / name / f).exists():
            shutil.copy(ROOT / "results" / name / f, d / f)
    before = (d / "sweep.json").read_text()
    config = importlib.import_module(f"experiments.configs.{module}").get_config("")
    assert launch.run_sweep(config, str(d), log=_quiet) == []
    if "trials" in json.loads(before):  # an older file is compared, not rewritten ...
        assert (d / "sweep.json").read_text() == before
    else:  # ... unless it lacks the base grid, which is then added
        assert definition_diff(json.loads(before), json.loads((d / "sweep.json").read_text())) == []


def test_ramps_refuse_a_batch_size_the_sweep_lacks_and_a_sweep_of_another_config(tmp_path):
    c = digits_ramps.get_config("tiny")
    c.ramps = [dict(c.ramps[1]) | {"learning_rate": "best@16"}]
    with pytest.raises(ValueError, match=r"config.ramps\[0\].learning_rate: 'best@16' names a "
                                         r"batch size the sweep does not train"):
        ramps.run_ramps(c, str(tmp_path / "none"), log=_quiet)
    assert not (tmp_path / "none").exists()
    d = _defined(tmp_path, digits_sweep.get_config("tiny"))
    other = digits_ramps.get_config("tiny")
    other.optim.name = "sgd"
    with pytest.raises(ValueError) as err:
        ramps.run_ramps(other, d, log=_quiet, mesh=_one_device())
    assert "config.ramps: " in _one_line(err) and 'optim.name ("adam" -> "sgd")' in str(err.value)
    ramps.check_ramps(digits_ramps.get_config("tiny"), d, mesh=_one_device())  # its own sweep


def test_a_recorded_ramp_with_another_spec_is_refused():
    run = {"label": "step", "learning_rate": "best@8", "schedule": {"kind": "step"}}
    done = {"step": {"label": "step", "spec": run | {"micro_batch": 8}}}
    ramps._check_recorded(done, run | {"micro_batch": 8})
    ramps._check_recorded({"step": {"label": "step"}}, run)  # older record without a spec
    with pytest.raises(ValueError, match=r"'step' is recorded with a different spec "
                                         r"\(micro_batch \(8 -> 16\)\); give the changed ramp"):
        ramps._check_recorded(done, run | {"micro_batch": 16})


def test_a_branch_workdir_refuses_another_config(tmp_path):
    c = digits_branch.get_config("tiny")
    branches.write_definition(c, str(tmp_path))
    branches.write_definition(c, str(tmp_path))  # the same: accepted
    other = digits_branch.get_config("tiny")
    other.model.hidden_sizes, other.branch.ks = (16,), (1, 2)
    with pytest.raises(ValueError) as err:
        branches.write_definition(other, str(tmp_path))
    assert "branch.ks" in _one_line(err) and "model.hidden_sizes" in str(err.value)
    old = json.loads((tmp_path / "branch.json").read_text())
    del old["config"]  # a branch.json of an older version: its branch section is compared
    (tmp_path / "branch.json").write_text(json.dumps(old))
    branches.write_definition(c, str(tmp_path))


# ------------------------------------------- 2, 3. estimators refuse what they cannot measure

def _regression_batch(n: int = 16):
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((n, 4)).astype(np.float32),
            "y": rng.standard_normal(n).astype(np.float32)}


class _LinenBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
        return nn.Dense(1)(nn.relu(h))[:, 0]


class _NnxBN(nnx.Module):
    def __init__(self, rngs):
        self.dense, self.bn = nnx.Linear(4, 8, rngs=rngs), nnx.BatchNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.bn(self.dense(x))))[:, 0]


def _estimators(loss_fn, params, batch):
    """Every public route: exact (ghost, vmap, curvature), probe, the jitted drop-in and the
    ghost norms alone."""
    yield lambda: noise.exact(loss_fn, params, batch)
    yield lambda: noise.exact(loss_fn, params, batch, method="vmap")
    yield lambda: noise.exact(loss_fn, params, batch, curvature=True)
    yield lambda: noise.probe(loss_fn, params, batch, jax.random.key(0))
    yield lambda: jax.jit(dropin.value_grad_and_stats(loss_fn))(params, batch)
    yield lambda: ghost.per_example_grads_info(loss_fn, params, batch)


def _refused_everywhere(loss_fn, params, batch, match: str) -> None:
    for call in _estimators(loss_fn, params, batch):
        with pytest.raises(ValueError, match=match) as err:
            call()
        _one_line(err)


def test_linen_batchnorm_in_training_mode_is_refused_and_eval_mode_is_measured():
    batch, model = _regression_batch(), _LinenBN()
    variables = model.init(jax.random.key(0), batch["x"], False)

    def train_mode(params, batch):
        out, _ = model.apply({"params": params, "batch_stats": variables["batch_stats"]},
                             batch["x"], True, mutable=["batch_stats"])
        return jnp.mean((out - batch["y"]) ** 2)

    def eval_mode(params, batch):
        out = model.apply({"params": params, "batch_stats": variables["batch_stats"]},
                          batch["x"], False)
        return jnp.mean((out - batch["y"]) ** 2)

    _refused_everywhere(train_mode, variables["params"], batch,
                        r"couples the examples of a batch: .*BatchNorm in training mode")
    assert np.isfinite(float(noise.exact(eval_mode, variables["params"], batch).trace_sigma))


def test_nnx_batchnorm_in_training_mode_is_refused_by_name():
    model = _NnxBN(nnx.Rngs(0))
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, batch):
        return jnp.mean((nnx.merge(graphdef, params, rest)(batch["x"]) - batch["y"]) ** 2)

    _refused_everywhere(loss_fn, params, _regression_batch(),
                        r"updates BatchNorm statistics .*model.eval\(\)")


def test_dropout_with_a_fixed_key_is_refused_unless_declared_per_example():
    key, batch = jax.random.key(3), _regression_batch()
    params = {"w": jnp.ones((4, 3))}

    def loss_fn(params, batch):  # dropout whose mask depends on the batch's shape
        h = batch["x"] @ params["w"]
        keep = jax.random.bernoulli(key, 0.5, h.shape)
        return jnp.mean((jnp.where(keep, h, 0.0).sum(-1) - batch["y"]) ** 2)

    _refused_everywhere(loss_fn, params, batch, r"draws random numbers .*\(random_bits in its "
                                                r"jaxpr.*noise.allow_randomness")

    def per_example(params, batch):  # each example's mask from its own id: the same anywhere
        h = batch["x"] @ params["w"]
        keep = jax.vmap(lambda i: jax.random.bernoulli(jax.random.fold_in(key, i), 0.5, (3,)))(
            batch["id"])
        return jnp.mean((jnp.where(keep, h, 0.0).sum(-1) - batch["y"]) ** 2)

    batch["id"] = np.arange(16, dtype=np.int32)
    declared = loss_checks.allow_randomness(per_example)
    auto, vmap = (noise.exact(declared, params, batch, method=m) for m in ("auto", "vmap"))
    np.testing.assert_allclose(auto.trace_sigma, vmap.trace_sigma, rtol=1e-5)


def test_a_summed_loss_is_refused_under_jit_at_trace_time_only():
    batch, params = _regression_batch(), {"w": jnp.ones((4, 3))}

    def sum_loss(params, batch):
        return jnp.sum(((batch["x"] @ params["w"]).sum(-1) - batch["y"]) ** 2)

    with pytest.raises(ValueError, match=r"looks like a SUM over the batch") as err:
        jax.jit(dropin.value_grad_and_stats(sum_loss))(params, batch)
    _one_line(err)

    def mean_loss(params, batch):
        return jnp.mean(((batch["x"] @ params["w"]).sum(-1) - batch["y"]) ** 2)

    step = dropin.value_grad_and_stats(mean_loss)
    first = str(jax.make_jaxpr(step)(params, batch))  # traced with the check (it ran here) ...
    assert str(jax.make_jaxpr(step)(params, batch)) == first  # ... and with it cached: the
    #   check stages nothing into the step, so a jitted step pays nothing for it


# ------------------------------------------------------ 4. configs fail before anything is written

def test_a_model_that_cannot_be_built_fails_the_sweep_before_anything_is_written(tmp_path):
    c = digits_sweep.get_config("tiny")
    c.model.hidden_sizes = (0,)
    with pytest.raises(ValueError, match=r"^config.model: model.hidden_sizes=\(0,\) must be "
                                         r"positive") as err:
        launch.run_sweep(c, str(tmp_path / "sweep"), log=_quiet)
    _one_line(err)
    assert not (tmp_path / "sweep").exists()


def test_the_sweep_command_with_an_unbuildable_model_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "sweep"
    proc = _warm.python(
        ["-m", "experiments.sweep",
         f"--config={ROOT / 'experiments' / 'configs' / 'digits_sweep.py'}:tiny",
         f"--sweep_dir={out}", "--config.model.hidden_sizes=(0,)"], env=_subprocess_env())
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == cli.USER_ERROR_EXIT and len(lines) == 1, lines
    assert lines[0].startswith("error: config.model: model.hidden_sizes=(0,) must be positive")
    assert not out.exists()


def test_a_single_run_that_fails_before_its_first_checkpoint_leaves_no_workdir(tmp_path,
                                                                             monkeypatch):
    c = digits_mlp.get_config("tiny")
    c.train.progress_bar = False
    workdir = tmp_path / "run"

    def crash(self):  # config.json, status.json, metrics.jsonl and checkpoints/ now exist
        assert (workdir / "config.json").exists()
        raise RuntimeError("injected failure at the first step")

    monkeypatch.setattr(loop.Loop, "_iterate", crash)
    with pytest.raises(RuntimeError, match="injected"):
        trainer.run(c, str(workdir), mesh=_one_device())
    assert not workdir.exists()
    monkeypatch.undo()
    c.train.max_steps = 10
    assert trainer.run(c, str(workdir), mesh=_one_device())["status"] == "finished"


def _one_device():
    return mesh_lib.make_mesh(data=1, model=1, devices=jax.devices()[:1])


@pytest.mark.slow
def test_the_tiny_ramps_run_beside_their_own_tiny_sweep(tmp_path):
    c = digits_ramps.get_config("tiny")
    d = str(tmp_path / "sweep")
    launch.run_sweep(c, d, log=_quiet)
    out = ramps.run_ramps(c, d, log=_quiet, mesh=_one_device())
    assert [r["label"] for r in out] == [run["label"] for run in c.ramps]
    assert all(r["spec"]["label"] == r["label"] for r in out)


# ------------------------------------------------------------------ 5. bit-identical resumes

def _without_seconds(store_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in SweepStore(store_dir).records()]


def _two_groups():
    c = digits_sweep.get_config("tiny")
    c.sweep.batch_sizes, c.sweep.seeds = (8, 16), (0,)  # one group of two rates per B
    return c


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The finished unsharded sweep of `_two_groups` (both tests below read it)."""
    d = tmp_path_factory.mktemp("whole")
    launch.run_sweep(_two_groups(), str(d), log=_quiet)
    return d


@pytest.mark.xdist_group("faults_silent_whole")  # one worker makes the module's `whole`
def test_a_rerun_of_part_of_a_vmapped_group_gives_bit_identical_records(tmp_path, whole):
    c = _two_groups()
    expected = _without_seconds(whole)
    lost = [r for r in expected if r["batch_size"] == 8][1]["trial_id"]  # second slot, B = 8
    for case in ("replayed", "retrained"):
        d = tmp_path / case
        shutil.copytree(whole, d)
        for part in map(pathlib.Path, shared.part_paths(d / "trials.jsonl")):  # lose it
            lines = part.read_text().splitlines(keepends=True)
            part.write_text("".join(x for x in lines if lost not in x))
        if case == "retrained":  # no run directory to replay: the group trains again
            shutil.rmtree(d / "groups")
        out = launch.run_sweep(c, str(d), log=_quiet)
        assert [r.trial_id for r in out] == [lost]
        again = {r["trial_id"]: r for r in _without_seconds(d)}
        assert [again[r["trial_id"]] for r in expected] == expected, case


@pytest.mark.xdist_group("faults_silent_whole")
def test_a_sharded_sweep_gives_the_records_of_an_unsharded_one(tmp_path, whole):
    c = _two_groups()
    trials = grid.make_trials(c.sweep)
    owned = [grid.shard_trials(trials, f"{i}/2", c.sweep.batch_sizes) for i in (0, 1)]
    for mine in owned:  # every (B, seed) group lies whole in one shard
        groups = {(t.batch_size, t.seed) for t in mine}
        assert mine == [t for t in trials if (t.batch_size, t.seed) in groups]
    assert sorted(t.index for m in owned for t in m) == [t.index for t in trials]
    sharded = tmp_path / "sharded"
    for i in (1, 0):  # in either order
        launch.run_sweep(c, str(sharded), shard=f"{i}/2", log=_quiet)
    by_id = lambda d: {r["trial_id"]: r for r in _without_seconds(d)}
    assert by_id(sharded) == by_id(whole)  # the analysis reads only these: the same report


# ------------------------------------------------------------- 6. disk full while writing

def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_leaves_the_replaced_file_whole_and_names_it(tmp_path, monkeypatch):
    path = tmp_path / "sweep.json"
    records.write_json_atomic(path, {"old": 1})
    monkeypatch.setattr(records.os, "fsync", _enospc)
    with pytest.raises(OSError) as err:
        records.write_json_atomic(path, {"new": 2})
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    assert cli.message(err.value) == f"No space left on device (ENOSPC): {path}"
    assert json.loads(path.read_text()) == {"old": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.json"]  # no temporary file left


def test_a_full_disk_part_way_through_an_append_leaves_no_torn_record(tmp_path, monkeypatch):
    path = tmp_path / "trials.jsonl"
    records.append_records(path, [{"trial_id": "a", "index": 0}])
    before = path.read_bytes()
    real_write = os.write

    def half_then_full(fd, data):  # the device fills up in the middle of the record
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(records.os, "write", half_then_full)
    with pytest.raises(OSError, match="No space left") as err:
        records.append_records(path, [{"trial_id": "b", "index": 1}])
    assert err.value.filename == str(path) and path.read_bytes() == before
    monkeypatch.setattr(records.os, "write", lambda fd, data: real_write(fd, data[:3]))
    with pytest.raises(OSError, match="No space left"):  # a short write counts as full
        records.append_records(path, [{"trial_id": "b", "index": 1}])
    assert path.read_bytes() == before


def test_a_full_disk_during_a_checkpoint_is_one_os_error_naming_the_directory(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", async_save=False)
    state = {"w": jnp.ones(3)}
    assert ckpt.save(1, state, {"step": 1})

    def tensorstore_full(*_args, **_kwargs):  # what a full disk looks like through orbax
        raise ValueError("RESOURCE_EXHAUSTED: Error writing local file "
                         "\"/x/ocdbt.process_0/d/1234\": No space left on device\n" * 50)

    ckpt._manager.save = tensorstore_full
    with pytest.raises(OSError) as err:
        ckpt.save(2, state, {"step": 2})
    assert err.value.errno == errno.ENOSPC and err.value.filename == "/x/ocdbt.process_0/d/1234"
    assert "\n" not in cli.message(err.value)
    ckpt._manager.save = lambda *a, **k: (_ for _ in ()).throw(KeyError("a bug"))
    with pytest.raises(KeyError):  # anything else keeps its own error
        ckpt.save(2, state, {"step": 2})
    ckpt.close()
    restored, meta = checkpoint.Checkpointer(tmp_path / "checkpoints").restore(None, state)
    assert meta["step"] == 1 and np.array_equal(restored["w"], state["w"])


def _file_size_limit(limit: int):
    """For a child process: files larger than `limit` bytes cannot be written (EFBIG, the
    signal ignored), as a full disk refuses them, without needing one."""
    import resource
    import signal

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_checkpoint_that_cannot_be_written_is_one_line_without_orbax_tracebacks(tmp_path):
    """A real write failure inside orbax's background threads (each logs a traceback, and
    tensorstore's callbacks report more when its event loop is gone): the terminal gets only
    the one-line error naming the path and the errno (status 2). On a full tmpfs the same
    command printed 358 lines before (`No space left on device (ENOSPC): ...`)."""
    workdir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "experiments.main",
         f"--config={ROOT / 'experiments' / 'configs' / 'digits_mlp.py'}:tiny",
         f"--workdir={workdir}"],
        cwd=ROOT, env=_subprocess_env(), capture_output=True, text=True, timeout=300,
        preexec_fn=_file_size_limit(60_000))
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(lines) <= 3, lines[:20]
    assert lines[-1].startswith(f"error: File too large (EFBIG): {workdir}"), lines
