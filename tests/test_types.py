"""The library type-checks: mypy over cbs/ with the settings of [tool.mypy] in pyproject.toml
reports no error."""

import pathlib

from mypy import api  # in the test extra: a missing checker fails here, it is never skipped

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_mypy_finds_no_error_in_cbs(tmp_path):
    stdout, stderr, status = api.run([
        "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
        str(ROOT / "cbs")])
    assert status == 0, stdout + stderr
