"""cbs.results.paths and the writers on top of it: local paths (str, pathlib, epath) behave as
before, and a gs:// directory works through etils.epath (here an in-memory file system
registered for the gs protocol, so nothing leaves the machine)."""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import sys
import warnings

import pytest
from etils import epath
from etils.epath import backend as epath_backend
from fsspec.implementations.memory import MemoryFileSystem

from cbs.results import files, paths, records
from cbs.results.store import SweepStore, TrialResult
from cbs.runtime import checkpoint, writer


class FakeGCS(MemoryFileSystem):
    """An in-memory object store answering gs:// (its own store, not the memory:// one)."""

    protocol = ("gs", "gcs")
    store: dict = {}
    pseudo_dirs = [""]


@pytest.fixture
def gcs(monkeypatch):
    """gs://bucket served by FakeGCS through epath's fsspec backend; yields the store."""
    FakeGCS.store.clear()
    FakeGCS.pseudo_dirs[:] = [""]
    registry = importlib.import_module("fsspec.registry")._registry
    for protocol in FakeGCS.protocol:
        monkeypatch.setitem(registry, protocol, FakeGCS)  # restored afterwards
    monkeypatch.setattr(paths, "_gcs_backend_installed", lambda: True)
    monkeypatch.setenv("EPATH_USE_TF", "false")
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    yield FakeGCS.store
    epath_backend.fsspec_backend._get_filesystem.cache_clear()


def _records(n: int, start: int = 0) -> list[dict]:
    return [{"step": s, "kind": "train", "train/loss": 1.0 / (s + 1)} for s in
            range(start, start + n)]


@pytest.mark.parametrize("kind", ["str", "pathlib", "epath", "gs"])
def test_records_round_trip_on_every_kind_of_path(tmp_path, kind, request):
    base = {"str": str(tmp_path), "pathlib": tmp_path, "epath": epath.Path(tmp_path),
            "gs": "gs://bucket/run"}[kind]
    if kind == "gs":
        request.getfixturevalue("gcs")
    path = paths.join(base, files.METRICS_FILE)
    assert paths.is_remote(path) == (kind == "gs")
    paths.makedirs(base)
    assert records.read_records(path) == [] and records.read_json(
        paths.join(base, "status.json")) is None
    records.append_records(path, _records(3))
    records.append_records(path, _records(2, start=3))
    assert [r["step"] for r in records.read_records(path)] == [0, 1, 2, 3, 4]
    assert records.truncate_records(path, 2) == 3
    assert [r["step"] for r in records.read_records(path)] == [0, 1]
    records.write_json_atomic(paths.join(base, "status.json"), {"status": "running"})
    records.write_json_atomic(paths.join(base, "status.json"), {"status": "finished"})
    assert records.read_json(paths.join(base, "status.json")) == {"status": "finished"}
    if kind == "gs":
        assert sorted(k.rsplit("/", 1)[-1] for k in request.getfixturevalue("gcs")) == [
            "metrics.jsonl", "status.json"]  # the objects are in the (fake) store
    else:
        assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "status.json"]  # no tmp left


@pytest.mark.parametrize("remote", [False, True])
def test_a_torn_tail_is_cut_before_the_next_append(tmp_path, remote, request):
    path = "gs://bucket/run/metrics.jsonl" if remote else str(tmp_path / "metrics.jsonl")
    if remote:
        request.getfixturevalue("gcs")
    records.append_records(path, _records(2))
    raw = paths.read_bytes(path) + b'{"step": 2, "ki'  # a kill mid-write
    records.write_atomic(path, raw)
    assert [r["step"] for r in records.read_records(path)] == [0, 1]  # the tail is no record
    with pytest.warns(records.CorruptRecordWarning, match="torn last line"):
        records.append_records(path, _records(1, start=2))
    assert [r["step"] for r in records.read_records(path)] == [0, 1, 2]
    assert paths.read_bytes(path).endswith(b"}\n")


def test_write_atomic_writes_the_same_bytes_as_before(tmp_path):
    """The one helper keeps the local files byte for byte (indent=1, sorted keys)."""
    path = tmp_path / "status.json"
    records.write_json_atomic(path, {"b": 1, "a": [1.5, None]})
    assert path.read_text() == '{\n "a": [\n  1.5,\n  null\n ],\n "b": 1\n}'
    records.write_atomic(str(path), b"raw")
    assert path.read_bytes() == b"raw"


def test_sweep_store_in_a_gs_directory(gcs, tmp_path):
    store = SweepStore("gs://bucket/sweep")
    assert store.trial_dir(type("T", (), {"trial_id": "t1"})) == "gs://bucket/sweep/trials/t1"
    store.write_definition({"sweep": {"x": 1}, "config": {}, "trials": []})
    assert store.definition()["sweep"] == {"x": 1}
    result = TrialResult("t1", 0, 32, 0.1, 0, "done", "loss", {"1": 10.0}, {"1": 320.0},
                         {"1": {"b_simple": 5.0}}, 10, 0.9, {}, 1.0)
    store.append([result])
    store.append([result])  # a repeated append is ignored by the reader
    assert [r["trial_id"] for r in store.records()] == ["t1"]
    csv_path = store.export_csv()
    assert csv_path == "gs://bucket/sweep/trials.csv"
    text = paths.read_bytes(csv_path).decode()
    assert text.splitlines()[1].startswith("t1,32,0.1,0,done,1,10.0,320.0,5.0")
    assert [k.rsplit("/", 2)[-2] for k in gcs if "/trials.d/" in k or k.endswith(
        ".jsonl")] == ["trials.d"] * 2  # a part per write, no shared file
    # claims on an object store are lease objects in the sweep directory
    assert store.lock_dir == "gs://bucket/sweep/locks"
    held = store.claim("g0")
    try:
        assert held is not None and store.claim("g0") is None
        assert store.claim_names() == ["g0"]
    finally:
        store.release(held)
    assert store.claim_names() == []


def test_sweep_store_accepts_path_objects(tmp_path):
    for sweep_dir in (tmp_path / "a", epath.Path(tmp_path / "b")):
        store = SweepStore(sweep_dir)
        store.write_definition({"sweep": {}, "config": {}, "trials": []})
        assert store.lock_dir == os.path.join(os.fspath(sweep_dir), "locks")
        assert pathlib.Path(sweep_dir, "sweep.json").exists()


def test_metrics_writer_on_gs_holds_records_until_sync(gcs):
    w = writer.MetricsWriter("gs://bucket/run", progress=False, tensorboard=False)
    w.write(_records(3))
    assert records.read_records(w.path) == []  # an object store has no append: held
    w.sync()
    assert [r["step"] for r in records.read_records(w.path)] == [0, 1, 2]
    w.write(_records(1, start=3))
    w.close()
    assert [r["step"] for r in records.read_records(w.path)] == [0, 1, 2, 3]
    resumed = writer.MetricsWriter("gs://bucket/run", start_step=2, progress=False,
                                   tensorboard=False)  # a restore to step 2
    resumed.close()
    assert [r["step"] for r in records.read_records(w.path)] == [0, 1]


def test_metrics_writer_on_an_epath_local_directory(tmp_path):
    w = writer.MetricsWriter(epath.Path(tmp_path / "run"), progress=False, tensorboard=False)
    w.write(_records(2))
    assert [r["step"] for r in records.read_records(tmp_path / "run" / "metrics.jsonl")] == [
        0, 1]  # locally every write is appended at once
    w.close()


def test_missing_tensorboardx_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r'pip install -e "\.\[tensorboard\]"'):
        writer.MetricsWriter(str(tmp_path), progress=False, tensorboard=True)


def test_gs_without_a_backend_names_the_extra(monkeypatch):
    monkeypatch.setattr(paths, "_gcs_backend_installed", lambda: False)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[gcs\]"'):
        records.read_json("gs://bucket/run/status.json")


def test_checkpointer_takes_an_epath_directory(tmp_path):
    import jax.numpy as jnp

    ckpt = checkpoint.Checkpointer(epath.Path(tmp_path / "ckpt"), async_save=False)
    assert ckpt.directory == str(tmp_path / "ckpt")
    ckpt.save(1, {"w": jnp.arange(3.0)}, {"examples_seen": 7})
    ckpt.wait()
    state, meta = ckpt.restore(None, {"w": jnp.zeros(3)})
    ckpt.close()
    assert meta == {"examples_seen": 7} and state["w"].tolist() == [0.0, 1.0, 2.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.Checkpointer(str(tmp_path / "ckpt")).close()  # a str sees the same


# Only cbs.results.paths touches the file system for run and sweep paths, so that every
# command works on gs:// as on a local disk. The other places that may, and why:
TOUCH_ALLOWED = {
    "cbs.analysis.reports.plots:save_figure": "renders the PNG into memory (`records.write_atomic` "
                                      "writes it)",
    "cbs.commands": "finds the checkout of the --config file, a source file",
    "cbs.configs": "lists and reads the preset files shipped inside the package",
    "cbs.data.embedded": "reads the data files of installed packages (digits, Shakespeare)",
    "cbs.results.records": "the local branch of an atomic replacement (temporary file, "
                           "fsync, rename) and of an O_APPEND append, after `paths.is_remote`",
    "cbs.results.calibration": "reads the calibration file shipped inside the package",
    "cbs.results.extras": "reads pyproject.toml of a source checkout (how cbs was installed), "
                          "not a run path",
    "cbs.results.leases": "fcntl locks on a local lock file (object stores: "
                          "`paths.create_new`)",
    "cbs.results.writers": "appends metrics to a local file on an O_APPEND descriptor "
                           "(object stores: written whole through `records`)",
}
_OS_CALLS = {"open", "makedirs", "mkdir", "remove", "unlink", "rmdir", "removedirs", "rename",
             "renames", "replace", "listdir", "scandir", "walk", "stat", "link", "symlink",
             "truncate", "chmod", "utime"}
_OS_PATH_CALLS = {"exists", "lexists", "isdir", "isfile", "islink", "getsize", "getmtime",
                  "samefile"}
_MODULE_CALLS = {"glob.glob", "glob.iglob", "np.save", "np.savez", "np.load", "np.loadtxt",
                 "np.savetxt", "numpy.save", "numpy.load"}
_NOT_FILES = {"shutil.get_terminal_size", "shutil.which"}
_PATH_METHODS = {"read_text", "read_bytes", "write_text", "write_bytes", "mkdir", "unlink",
                 "rmdir", "touch", "glob", "rglob", "iterdir", "exists", "is_file", "is_dir",
                 "rename", "savefig"}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _file_system_calls(source: str, filename: str) -> list[tuple[str, int, str]]:
    """(enclosing function, line, call) of each call in `source` that touches the file system
    directly: the built-in `open`, os and os.path calls on files, glob, shutil, numpy's file
    functions, and the methods of path objects (`Path(...).write_text`, `fig.savefig`)."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call):
            name, func = _dotted(node.func), node.func
            receiver = _dotted(func.value) if isinstance(func, ast.Attribute) else None
            if (name == "open" or name in _MODULE_CALLS
                    or (name or "").startswith(("shutil.", "tempfile.")) and name not in _NOT_FILES
                    or name and name.count(".") == 1 and name.startswith("os.")
                    and name[3:] in _OS_CALLS
                    or name and name.startswith("os.path.") and name[8:] in _OS_PATH_CALLS
                    or isinstance(func, ast.Attribute) and func.attr in _PATH_METHODS
                    and receiver not in ("paths", "os", "os.path")):
                found.append((function, node.lineno, ast.unparse(node.func)))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source, filename), "")
    return found


def test_only_the_paths_module_touches_the_file_system():
    """Every other module reaches run and sweep directories through `cbs.results.paths` (or
    `records`, on top of it), so nothing writes a local directory named `gs:`; the places that
    may touch files directly are listed in TOUCH_ALLOWED with their reasons."""
    root = pathlib.Path(__file__).resolve().parent.parent / "cbs"
    offending = []
    for file in sorted(root.rglob("*.py")):
        parts = file.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if module == "cbs.results.paths" or module in TOUCH_ALLOWED:
            continue
        offending += [f"{file.relative_to(root.parent)}:{line} {call}(...) in {function}()"
                      for function, line, call in _file_system_calls(file.read_text(), str(file))
                      if f"{module}:{function}" not in TOUCH_ALLOWED]
    assert not offending, "go through cbs.results.paths:\n" + "\n".join(offending)


def test_the_file_system_scan_sees_each_kind_of_call():
    source = """
def f(fig, p, path):
    open(p)
    os.makedirs(p, exist_ok=True)
    os.path.exists(p)
    glob.glob(p)
    shutil.copy(p, p)
    pathlib.Path(p).write_text("x")
    fig.savefig(p)
    paths.exists(p)  # the layer itself: not flagged
    shutil.get_terminal_size()
    os.path.join(p, "a")
"""
    assert [line for _, line, _ in _file_system_calls(source, "f.py")] == list(range(3, 10))
