"""Test session set-up: 8 fake CPU devices (set before JAX starts), a persistent XLA
compilation cache shared by the session's processes, and float64 on demand."""

import os
import shutil
import tempfile


# XLA's backend optimisation level 0 (LLVM code generation without its optimisation passes)
# about halves the compile time of the small programs the tests compile by the hundred, which
# then run for milliseconds; the arithmetic is the same (no fast-math either way), only the
# generated code is slower. XLA:CPU's older elemental emitters instead of its fusion emitters
# (`xla_cpu_use_fusion_emitters=false`) halve it again: tests/test_ghost.py compiles its 528
# programs in 44 CPU-s instead of 104, and runs in 131 instead of 194. Tests that start a
# process with its own XLA_FLAGS pass these on (SUBPROCESS_XLA_FLAGS).
# XLA aborts at start on a flag it does not know: the emitter switch is gone from the XLA of
# JAX 0.11, so it is passed only to older ones (tests/test_newest.py runs the newest).
def _jax_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(p) for p in version("jax").split(".")[:2])


SUBPROCESS_XLA_FLAGS = "--xla_backend_optimization_level=0" + (
    " --xla_cpu_use_fusion_emitters=false" if _jax_version() < (0, 11) else "")
os.environ.setdefault("XLA_FLAGS",
                      f"--xla_force_host_platform_device_count=8 {SUBPROCESS_XLA_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# gcsfs (read at its import) would ask a gRPC control API for the type of every bucket of the
# GCS emulator the object-store tests start, and wait a minute for each answer
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

# Many tests build a fresh Trainer (new jitted closures) for programs that an earlier test,
# or another xdist worker, already compiled; the cache turns those compilations into reads.
# The first process to import this file (the xdist controller) makes the directory; workers
# and the subprocesses tests start inherit it through the environment.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="cbs-test-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Lowering writes each operation's Python traceback (up to 100 frames, pytest's included)
# into the program as its location; only the innermost frame is kept here, which makes
# lowering about a tenth cheaper. Locations are debug information: the compiled programs,
# and the persistent cache's keys (computed without them), are the same.
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

# The modules with the longest tests run first: with two xdist workers taking tests in
# collection order, a long test collected last keeps one worker busy while the other idles.
_LONGEST_FIRST = ("test_notebooks.py", "test_lm.py", "test_branches.py", "test_multihost.py",
                  "test_throughput.py", "test_types.py", "test_preemption.py",
                  "test_sweep_lifecycle.py", "test_ghost.py", "test_ghost_stats.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: others keep
    #                                                                   their order


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def x64():
    """Runs the test with float64 enabled, restoring the previous setting afterwards."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


@pytest.fixture(scope="module")
def mlp():
    """(loss_fn, params, batch of 32 digits): an MLP 64-16-10 (test files with a model of
    their own define their own `mlp`)."""
    from cbs import data, models

    mc = models.default_model_config("mlp")
    mc.hidden_sizes = (16,)
    model = models.build_model(mc, input_shape=(64,), num_classes=10, rngs=nnx.Rngs(0),
                               verbose=False)
    graphdef, params, rest = models.split_model(model)
    batch = data.get_dataset("digits").split("train").read(np.arange(32))
    return models.make_loss_fn(graphdef, rest, "classification"), params, batch


class MeasuredStep:
    """A `TrainStep` with its `cbs.engine.measure.Measurement`, called like the step: the
    t-th call is step t (measuring when due) and returns the record fields of its metrics."""

    def __init__(self, train_step, spec, *, seed: int = 0):
        from cbs.engine.measure import Measurement

        self.train_step, self.measurement, self.t = train_step, Measurement(
            spec, train_step, seed=seed), 0
        self.layout = train_step.layout

    def __call__(self, state, inputs, accum_steps):
        state, values = self.measurement.step(state, inputs, accum_steps, self.t)
        fields = self.measurement.fields(self.t, jax.device_get(values))
        self.t += 1
        return state, fields


def make_train_step(loss_fn, params, direction, mesh, *, micro_batch, lr, stateful=False,
                    measure=None, **options):
    """(step, state): a `TrainStep` at a constant learning rate with the batch passed as
    inputs (a `MeasuredStep` with the spec `measure`), and a fresh state on `mesh`."""
    from cbs.engine import state as state_lib
    from cbs.engine import step
    from cbs.runtime import mesh as mesh_lib

    state = jax.jit(lambda p: state_lib.init_train_state(p, direction, learning_rate=lr),
                    out_shardings=mesh_lib.replicated(mesh))(params)
    layout = step.BatchLayout(mesh, jax.tree.map(lambda x: x.sharding, state),
                              mesh_lib.batch_sharding(mesh), micro_batch=micro_batch)
    fn = loss_fn if stateful else state_lib.stateless(loss_fn)
    ts = step.TrainStep(fn, direction, lambda lr, e, b: lr, layout,
                        step.StepOptions(**options))
    return (ts if measure is None else MeasuredStep(ts, measure)), state
