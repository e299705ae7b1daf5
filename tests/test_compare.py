"""Tests of cbs.analysis.studies.compare: the cross-study table and figure from small synthetic
study directories (records written by hand, no training)."""

import json
import math
import os

import pytest

from cbs.analysis.studies import compare
from cbs.results import files, records, store

S_MIN = 100.0


def _study(path, *, b_crit, optimizer, data, noise):
    """A sweep directory on S = S_MIN(1 + B_crit/B) at two targets whose best trials measured
    B_simple = noise·B_crit·(B/64)^0.1 and B_noise = B_simple/2 (a spread over batch sizes
    with median at B = 64 equal to noise·B_crit)."""
    os.makedirs(path)
    config = {"data": {"name": data}, "model": {"name": "mlp"}, "optim": {"name": optimizer}}
    targets = [0.5, 0.2]
    with open(os.path.join(path, "sweep.json"), "w") as f:
        json.dump({"config": config, "sweep": {"targets": targets}}, f)
    out = []
    for b in (4, 16, 64, 256, 1024):
        for lr, slow in ((0.01, 1.5), (0.02, 1.0)):
            steps, noise_at = {}, {}
            for k, t in enumerate(targets):
                bc = b_crit * (k + 1)
                key = store.target_key(t)
                steps[key] = slow * S_MIN * (1 + bc / b)
                bs = noise * bc * (b / 64) ** 0.1
                noise_at[key] = {"b_simple": bs, "b_noise": bs / 2}
            out.append(store.TrialResult(
                trial_id=f"b{b}_lr{lr}", index=len(out), batch_size=b, learning_rate=lr,
                seed=0, status="done", target_metric="full_train/loss",
                steps_to_target=steps,
                examples_to_target={k: v * b for k, v in steps.items()},
                noise_at_target=noise_at, final_steps=1000, final_metric=0.1,
                curve={"step": [0, 1000], "examples": [0, 1000 * b]}, seconds=0.0).to_json())
    records.append_records(store.SweepStore(path).path, out)
    return path


def test_cross_study_table_and_figure(tmp_path):
    a = _study(str(tmp_path / "adam_task"), b_crit=20.0, optimizer="adam", data="digits",
               noise=0.625)
    b = _study(str(tmp_path / "sgd_task"), b_crit=200.0, optimizer="sgd", data="mnist1d",
               noise=5.0)
    rows = compare.collect([a, b], bootstrap=0)
    assert [(r["study"], r["target"]) for r in rows] == [
        ("adam_task", 0.5), ("adam_task", 0.2), ("sgd_task", 0.5), ("sgd_task", 0.2)]
    first = rows[0]
    assert first["task"] == "digits/mlp" and first["optimizer"] == "adam"
    assert first["b_crit"] == pytest.approx(20.0, rel=1e-6)
    # Median over the 5 batch sizes is the B = 64 value; min and max at B = 4 and 1024.
    assert first["b_simple"] == pytest.approx(12.5, rel=1e-9)
    assert first["b_simple_range"] == pytest.approx((12.5 * (4 / 64) ** 0.1,
                                                      12.5 * (1024 / 64) ** 0.1), rel=1e-9)
    assert first["ratio_b_simple"] == pytest.approx(1.6, rel=1e-6)
    assert first["ratio_b_noise"] == pytest.approx(3.2, rel=1e-6)
    assert rows[3]["ratio_b_simple"] == pytest.approx(0.2, rel=1e-6)
    s = compare.summary(rows)
    assert s["b_crit_decades"] == pytest.approx(math.log10(400 / 20), rel=1e-6)
    assert s["b_simple"]["within_2x"] == 0.5 and s["b_simple"]["within_10x"] == 1.0
    assert s["b_noise"]["within_2x"] == 0.0
    path = compare.write_report([a, b], str(tmp_path / "out"), bootstrap=50)
    text = open(path).read()
    assert "| adam_task | digits/mlp | adam | 0.5 | 20 (" in text
    assert "| 1.6 | 3.2 |" in text  # the two ratios of the first point
    assert os.path.getsize(tmp_path / "out" / files.PER_TRIAL_FIGURE_FILE) > 10_000
    assert not (tmp_path / "out" / files.FIGURE_FILE).exists()  # no study has the protocol
    assert "No study has the protocol" in text and "## Per trial (second view)" in text
    with pytest.raises(ValueError, match="no finished trials"):
        compare.collect([str(tmp_path)], bootstrap=0)


def test_the_figure_leaves_the_plotting_backend_alone(tmp_path):
    """A notebook's backend stays its own: the figure is a matplotlib Figure, not pyplot."""
    import matplotlib

    a = _study(str(tmp_path / "adam_task"), b_crit=20.0, optimizer="adam", data="digits",
               noise=0.625)
    rows = compare.collect([a], bootstrap=20)
    before = matplotlib.get_backend()
    matplotlib.use("svg", force=True)  # a backend the old matplotlib.use("Agg") would replace
    try:
        compare.figure(rows, str(tmp_path / "figure.png"))
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before, force=True)
    assert os.path.getsize(tmp_path / "figure.png") > 10_000


def test_a_collapsed_interval_a_rounding_error_inside_its_point_is_drawn(tmp_path):
    """A bootstrap interval that collapses onto B_crit can end 3e-10 inside it (a negative
    error bar, which matplotlib refuses): it is drawn with no bar."""
    a = _study(str(tmp_path / "adam_task"), b_crit=20.0, optimizer="adam", data="digits",
               noise=0.625)
    rows = compare.collect([a], bootstrap=0)
    for r in rows:
        r["b_crit_ci"] = (r["b_crit"] + 3e-10, r["b_crit"] - 3e-10)
        lo, hi = r["b_simple_range"]
        r["b_simple_range"] = (r["b_simple"] + 1e-12, hi)
    path = compare.figure(rows, str(tmp_path / "fig.png"))
    assert os.path.getsize(path) > 10_000


def test_cbs_compare_writes_into_no_directory_the_user_did_not_name(tmp_path):
    """Without --out, `cbs-compare results/digits` from a checkout's root leaves the committed
    results/compare/ alone: the report goes to a new directory beside the study, another one
    on the next run; studies in different directories need --out (one line, nothing
    written)."""
    import _warm

    results = tmp_path / "results"
    _study(str(results / "digits"), b_crit=20.0, optimizer="adam", data="digits", noise=0.625)
    committed = results / "compare"
    committed.mkdir()
    (committed / "report.md").write_text("the committed comparison\n")
    args = ["-m", "experiments.compare", "results/digits", "--bootstrap=20"]
    for name in ("compare_digits", "compare_digits_2"):
        out = _warm.python(args, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert out.stderr == ""  # one study: no numpy warning either
        assert (results / name / "report.md").is_file()
        assert out.stdout.strip().splitlines()[-1].startswith(
            f"report: {results / name / 'report.md'} (a new directory beside the studies")
    assert (committed / "report.md").read_text() == "the committed comparison\n"
    assert sorted(os.listdir(committed)) == ["report.md"]
    other = _study(str(tmp_path / "elsewhere" / "digits_sgd"), b_crit=200.0, optimizer="sgd",
                   data="digits", noise=5.0)
    before = sorted(os.listdir(tmp_path))
    bad = _warm.python([*args, other], cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--out=DIR" in bad.stderr and sorted(os.listdir(tmp_path)) == before


def test_studies_whose_folders_share_a_name_stay_apart(tmp_path):
    """A study is its full path: x/task and y/task are two studies (two labels, two points
    each per target in the summary), not one merged study, and nothing goes to stderr."""
    import _warm

    x = _study(str(tmp_path / "x" / "task"), b_crit=20.0, optimizer="adam", data="digits",
               noise=0.625)
    y = _study(str(tmp_path / "y" / "task"), b_crit=200.0, optimizer="sgd", data="mnist1d",
               noise=5.0)
    out = _warm.python(["-m", "experiments.compare", x, y, f"--out={tmp_path / 'out'}",
                        "--bootstrap=20"])
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert "4 points from 2 studies" in out.stdout
    assert "| x/task | digits/mlp | adam |" in out.stdout
    assert "| y/task | mnist1d/mlp | sgd |" in out.stdout
    assert compare.study_labels([x, y]) == ["x/task", "y/task"]
    assert compare.study_labels([x, str(tmp_path / "x" / "other")]) == ["task", "other"]
    same = _warm.python(["-m", "experiments.compare", x, f"{x}/", f"--out={tmp_path / 'o2'}"])
    assert same.returncode == 2 and "name one study twice" in same.stderr


def test_a_held_out_prediction_is_found_beside_its_sweep_on_any_store():
    from cbs.analysis.studies import compare as compare_lib

    assert compare_lib.prediction_path("gs://bucket/runs/task/") == (
        "gs://bucket/runs/task_predict/prediction.json")
    assert compare_lib.prediction_path("results/heldout_lm_depth4") == (
        "results/heldout_lm_depth4_predict/prediction.json")
