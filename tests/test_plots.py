"""Tests for cbs.analysis.reports.plots: each figure is a decodable, non-blank PNG, even
degenerate."""

import matplotlib.image
import numpy as np
import pytest

from cbs.analysis.fits import fit
from cbs.analysis.reports import plots

B = np.array([4.0, 16.0, 64.0, 256.0, 1024.0])


def _series():
    out = []
    for target, (s_min, e_min) in {0.5: (100.0, 3200.0), 0.2: (300.0, 38400.0)}.items():
        steps = (s_min + e_min / B) * np.exp(0.05 * np.random.default_rng(0).standard_normal(5))
        out.append({"target": target, "batch_sizes": B, "steps": steps,
                    "fit": fit.fit_tradeoff(B, steps, bootstrap=20)})
    return out


def _check_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100
    assert img[..., :3].std() > 0.01  # something was drawn


def test_pareto_and_collapse(tmp_path):
    series = _series()
    assert all(item["fit"].ok for item in series)
    _check_png(plots.pareto_frontier(series, tmp_path / "pareto.png"))
    _check_png(plots.tradeoff_collapse(series, tmp_path / "sub" / "collapse.png"))


def test_b_crit_vs_loss(tmp_path):
    losses = np.array([0.5, 0.3, 0.2, 0.1])
    b_crits = 5.0 / losses ** 2
    law = fit.fit_power_law(losses, b_crits, bootstrap=20)
    path = plots.b_crit_vs_loss(
        losses, b_crits, tmp_path / "bcrit.png", b_crit_cis=[(b / 2, b * 2) for b in b_crits],
        power_law=law, measured={"B_simple": (losses, 2 * b_crits),
                                 "B_noise": (losses, b_crits / 2)})
    _check_png(path)
    _check_png(plots.b_crit_vs_loss(losses, b_crits, tmp_path / "plain.png"))


def test_noise_over_training_and_schedule(tmp_path):
    steps = np.arange(0, 200, 10.0)
    runs = [{"label": "B=32", "step": steps, "b_simple": 10 + steps, "b_noise": 5 + steps / 2},
            {"label": "B=128", "step": steps, "b_simple": np.where(steps > 50, 20.0, np.nan),
             "b_noise": []}]
    _check_png(plots.noise_over_training(runs, tmp_path / "noise.png"))
    ramp = {"label": "step ramp", "examples_seen": np.array([0, 100, 200, 400]),
            "batch_size": np.array([8, 8, 16, 32]), "lr": np.array([1.0, 1.0, 1.4, 2.0])}
    _check_png(plots.batch_size_schedule([ramp], tmp_path / "schedule.png"))


def test_se_plane_with_labelled_runs(tmp_path):
    item = _series()[0]
    runs = [{"label": "step ramp", "steps": 150.0, "examples": 9000.0},
            {"label": "adaptive", "steps": 130.0, "examples": 12000.0},
            {"label": "never reached", "steps": None, "examples": None}]
    path = plots.se_plane(item["fit"], tmp_path / "se.png",
                          points={"batch_sizes": item["batch_sizes"], "steps": item["steps"]},
                          runs=runs)
    _check_png(path)


NAN = float("nan")


@pytest.mark.parametrize("name", ["pareto", "collapse", "bcrit", "noise", "se", "schedule",
                                  "bcrit_nan", "se_zero", "pareto_empty_series"])
def test_degenerate_inputs_still_write_a_png(tmp_path, name):
    bad = fit.fit_tradeoff([8, 16], [10, 5])  # insufficient data
    series = [{"target": 0.1, "batch_sizes": [8, 16], "steps": [10, 5], "fit": bad}]
    path = tmp_path / f"{name}.png"
    if name == "pareto":
        plots.pareto_frontier([], path)
    elif name == "collapse":
        plots.tradeoff_collapse(series, path)
    elif name == "bcrit":
        plots.b_crit_vs_loss([], [], path, power_law=fit.fit_power_law([1.0], [2.0]))
    elif name == "noise":
        plots.noise_over_training([{"label": "x", "step": [0, 1]}], path)
    elif name == "se":
        plots.se_plane(bad, path)
    elif name == "schedule":
        plots.batch_size_schedule([], path)
    elif name == "bcrit_nan":  # no fit reached, measured values all missing
        plots.b_crit_vs_loss([0.5], [NAN], path, b_crit_cis=[(NAN, NAN)],
                             measured={"B_simple": ([0.5, 0.2], [NAN, NAN])})
    elif name == "se_zero":
        plots.se_plane(None, path, runs=[{"label": "a", "steps": 0.0, "examples": 0.0}])
    else:
        plots.pareto_frontier([{"target": 1, "batch_sizes": [], "steps": [], "fit": None}], path)
    assert path.stat().st_size > 1000


@pytest.fixture
def figures(monkeypatch):
    """The Figure objects the plot functions save, in order (drawn, so text has extents)."""
    saved = []
    save = plots.save_figure

    def keep(fig, path, dpi=120):
        saved.append(fig)
        return save(fig, path, dpi)

    monkeypatch.setattr(plots, "save_figure", keep)
    return saved


def _tick_labels_overlap(fig) -> list[tuple[str, str]]:
    """Pairs of neighbouring visible tick labels whose boxes intersect, on every axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    clashes = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            ticks = [t for t in axis.get_major_ticks() + axis.get_minor_ticks()
                     if lo <= t.get_loc() <= hi]
            labels = [t.label1 for t in ticks if t.label1.get_visible() and t.label1.get_text()]
            boxes = [(lab.get_text(), lab.get_window_extent(renderer)) for lab in labels]
            boxes = [(t, b) for t, b in boxes if b.width > 0]
            for i, (ta, a) in enumerate(boxes):
                clashes += [(ta, tb) for tb, b in boxes[i + 1:] if a.overlaps(b)]
    return clashes


@pytest.mark.parametrize("losses", [(0.5, 0.3, 0.2, 0.1, 0.05), (3.0, 2.6, 2.4, 2.2),
                                    (0.9, 0.5, 0.2, 0.1)])
def test_log_tick_labels_never_overlap(tmp_path, figures, losses):
    losses = np.asarray(losses)
    b_crits = 30.0 / losses ** 0.8
    plots.b_crit_vs_loss(losses, b_crits, tmp_path / "bcrit.png",
                         measured={"B_simple": (losses, b_crits / 3)})
    b = np.array([8.0, 32.0, 128.0])
    f = fit.fit_tradeoff(b, 2.3 * (1 + 117 / b), bootstrap=0)
    plots.se_plane(f, tmp_path / "se.png", points={"batch_sizes": b, "steps": 2.3 * (1 + 117 / b)},
                   runs=[{"label": "fixed B=32", "steps": 11.5, "examples": 370},
                         {"label": "adaptive", "steps": 12.0, "examples": 380}])
    for fig in figures:
        assert _tick_labels_overlap(fig) == []
    # every axis still names some values (a short range is labelled by minor ticks)
    ax = figures[0].axes[0]
    assert len([t for t in ax.get_xticklabels(minor=True) + ax.get_xticklabels() if t.get_text()
                and ax.get_xlim()[1] <= float(t.get_text()) <= ax.get_xlim()[0]]) >= 2


def test_noise_legend_has_one_entry_per_label_and_key(tmp_path, figures):
    steps = np.arange(1, 50, 5.0)
    batch_sizes = [4, 8, 16, 32, 64, 128, 256, 512, 1024]
    runs = [{"label": f"B={b}", "step": steps * b, "b_simple": 10 + steps + k,
             "b_noise": 5 + steps / 2 + k} for b in batch_sizes for k in range(4)]  # 36 runs
    _check_png(plots.noise_over_training(runs, tmp_path / "noise.png"))
    legend = figures[0].axes[0].get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts == [f"B={b}" for b in batch_sizes] + ["b_simple", "b_noise"]
    lines = figures[0].axes[0].get_lines()
    colors = {}
    for line in lines:  # the 4 runs of one label share its colour
        colors.setdefault(line.get_color() if isinstance(line.get_color(), str)
                          else tuple(line.get_color()), 0)
    assert len(colors) == len(batch_sizes)
