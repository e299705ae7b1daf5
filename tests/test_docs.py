"""The documentation site builds with no warning (Sphinx + MyST, API pages from docstrings)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_docs_build_without_warnings(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(ROOT / "docs"), str(tmp_path / "html")],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ("value_grad_and_stats", "best_per_batch_size", "joint_bootstrap",
                 "fit_tradeoff", "llama3_schedule"):
        assert name in api, f"the API page lacks {name}"
