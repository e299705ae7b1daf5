"""Test session set-up: 8 fake CPU devices (set before JAX starts), a persistent XLA
compilation cache shared by the session's processes, and float64 on demand."""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Many tests build a fresh Trainer (new jitted closures) for programs that an earlier test,
# or another xdist worker, already compiled; the cache turns those compilations into reads.
# The first process to import this file (the xdist controller) makes the directory; workers
# and the subprocesses tests start inherit it through the environment.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="cbs-test-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


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
