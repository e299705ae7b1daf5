"""Figures for batch-size studies: each function takes plain arrays, fit objects or lists of
dicts and a path, writes one PNG and returns the path. No model and no pyplot state: figures
are `matplotlib.figure.Figure` objects rendered by the Agg canvas, safe in scripts and threads.

Letters as in `cbs.analysis.fits.fit`: B batch size, S steps and E = B·S examples to a target loss,
S_min, E_min, B_crit = E_min/S_min the fitted trade-off, L the target loss.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

from cbs.analysis.fits.fit import PowerLawFit, TradeoffFit
from cbs.results import paths, records

__all__ = [
    "PathLike", "b_crit_vs_loss", "batch_size_schedule", "log_labels", "noise_over_training",
    "pareto_frontier", "save_figure", "se_plane", "tradeoff_collapse",
]

PathLike = str | os.PathLike


def save_figure(fig: Figure, path: PathLike, dpi: int = 120) -> str:
    """Writes `fig` as a PNG to `path` (local or gs://, `cbs.results.paths`); returns the path."""
    path = os.fspath(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    paths.makedirs(os.path.dirname(path) or ".")
    records.write_atomic(path, buffer.getvalue())
    return path


def _new(ncols: int = 1, width: float = 6.0) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(width * ncols, 4.5), layout="constrained")
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _no_data(ax, message: str = "no data") -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)


def log_labels(axis, values: np.ndarray) -> None:
    """Plain-number tick labels on a log axis; under 1.5 decades (maybe no major tick) the minor
    ticks at 2, 3 and 5 × 10^k too, under 0.5 decades about 8 evenly spaced ticks instead."""
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    axis.set_major_formatter(plain)
    lo, hi = (values.min(), values.max()) if values.size else (1.0, 1.0)
    span = np.log10(hi / lo)
    if span >= 1.5:
        axis.set_minor_formatter(NullFormatter())
        return
    if span < 0.5:
        axis.set_minor_locator(FixedLocator(list(_even_ticks(lo, hi))))
        axis.set_minor_formatter(plain)
        return

    def minor(v: float, _) -> str:
        if v <= 0:
            return ""
        mantissa = v / 10 ** math.floor(math.log10(v) + 1e-9)
        return f"{v:g}" if any(abs(mantissa - m) < 1e-6 for m in (2, 3, 5)) else ""

    axis.set_minor_formatter(FuncFormatter(minor))


def _even_ticks(lo: float, hi: float) -> np.ndarray:
    """About 8 round, evenly spaced ticks over [lo, hi] (padded), powers of ten left out."""
    scale = 10.0 ** math.floor(math.log10(lo))
    step = next(d * scale for d in (0.1, 0.2, 0.5, 1.0, 2.0, 5.0) if hi - lo <= 8 * d * scale)
    ticks = np.arange(math.floor(lo / 1.2 / step), math.ceil(hi * 1.2 / step) + 1) * step
    ticks = ticks[ticks > 0]
    decade = np.abs(np.log10(ticks) - np.round(np.log10(ticks))) < 1e-9
    return ticks[~decade]


def _finish(ax, *, logx: bool, logy: bool, legend: bool = True) -> bool:
    """Log scales only on axes with positive finite data (matplotlib refuses otherwise), a
    legend when something was drawn, else a "no data" note; returns whether it was."""
    xs, ys = [np.empty(0)], [np.empty(0)]
    for line in ax.get_lines():
        x = np.asarray(line.get_xdata(), dtype=np.float64)
        y = np.asarray(line.get_ydata(), dtype=np.float64)
        if x.shape != y.shape or line.get_transform() != ax.transData:
            continue  # reference lines drawn in axes coordinates
        ok = np.isfinite(x) & np.isfinite(y)
        xs.append(x[ok & (x > 0)])
        ys.append(y[ok & (y > 0)])
    has_x, has_y = np.concatenate(xs).size > 0, np.concatenate(ys).size > 0
    if logx and has_x:
        ax.set_xscale("log")
        log_labels(ax.xaxis, np.concatenate(xs))
    if logy and has_y:
        ax.set_yscale("log")
        log_labels(ax.yaxis, np.concatenate(ys))
    drawn = has_x and has_y
    if drawn and legend:
        ax.legend(fontsize=8)
    elif not drawn:
        _no_data(ax)
    return drawn


def _frontier(fit: TradeoffFit, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(S, E) along the fitted hyperbola over B_crit/30–30·B_crit and 2× beyond the points `b`."""
    lo = min([fit.b_crit / 30] + ([b.min() / 2] if b.size else []))
    hi = max([fit.b_crit * 30] + ([b.max() * 2] if b.size else []))
    grid = np.geomspace(lo, hi, 200)
    return fit.steps(grid), fit.examples(grid)


def pareto_frontier(series: Sequence[Mapping[str, Any]], path: PathLike, *,
                    title: str = "Steps vs examples to each target") -> str:
    """S (x) against E (y), log-log, one colour per target, with the fitted hyperbolas and
    B_crit (S = 2·S_min, E = 2·E_min) starred. series: dicts with "target", "batch_sizes",
    "steps" and optionally "fit" (TradeoffFit)."""
    fig, (ax,) = _new()
    for i, item in enumerate(series):
        color = f"C{i % 10}"
        b = np.asarray(item.get("batch_sizes", ()), dtype=np.float64)
        s = np.asarray(item.get("steps", ()), dtype=np.float64)
        fit = item.get("fit")
        label = f"L = {item.get('target')}"
        if fit is not None and fit.ok:
            label += f", B_crit = {fit.b_crit:.3g}"
            s_f, e_f = _frontier(fit, b)
            ax.plot(s_f, e_f, "-", color=color, lw=1.2)
            ax.plot([2 * fit.s_min], [2 * fit.e_min], "*", color=color, ms=12, mec="k")
        ax.plot(s, b * s, "o", color=color, label=label)
    ax.set(xlabel="steps S", ylabel="examples E = B·S", title=title)
    _finish(ax, logx=True, logy=True)
    return save_figure(fig, path)


def tradeoff_collapse(series: Sequence[Mapping[str, Any]], path: PathLike) -> str:
    """S/S_min, E/E_min against B/B_crit per fitted target, on 1 + 1/x and 1 + x (`series`)."""
    fig, (ax_s, ax_e) = _new(ncols=2, width=5.0)
    xs = []
    for i, item in enumerate(series):
        fit = item.get("fit")
        if fit is None or not fit.ok:
            continue
        b = np.asarray(item["batch_sizes"], dtype=np.float64)
        s = np.asarray(item["steps"], dtype=np.float64)
        x = b / fit.b_crit
        xs.append(x)
        kw = dict(color=f"C{i % 10}", ls="none", marker="o", label=f"L = {item.get('target')}")
        ax_s.plot(x, s / fit.s_min, **kw)
        ax_e.plot(x, b * s / fit.e_min, **kw)
    allx = np.concatenate(xs) if xs else np.array([0.1, 10.0])
    grid = np.geomspace(min(allx.min(), 0.1) / 2, max(allx.max(), 10.0) * 2, 200)
    ax_s.plot(grid, 1 + 1 / grid, "k--", lw=1, label="1 + B_crit/B")
    ax_e.plot(grid, 1 + grid, "k--", lw=1, label="1 + B/B_crit")
    ax_s.set(xlabel="B / B_crit", ylabel="S / S_min")
    ax_e.set(xlabel="B / B_crit", ylabel="E / E_min")
    for ax in (ax_s, ax_e):
        _finish(ax, logx=True, logy=True)
    if not xs:
        _no_data(ax_s, "no target with a fit")
    return save_figure(fig, path)


def b_crit_vs_loss(losses: Sequence[float], b_crits: Sequence[float], path: PathLike, *,
                   b_crit_cis: Sequence[tuple[float, float]] | None = None,
                   power_law: PowerLawFit | None = None,
                   measured: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
                   xlabel: str = "target loss L") -> str:
    """Fitted B_crit per target loss (with intervals), the power law and measured noise
    scales ({"B_simple": (losses, values), ...}); the loss axis runs right to left."""
    fig, (ax,) = _new()
    loss = np.asarray(losses, dtype=np.float64)
    bc = np.asarray(b_crits, dtype=np.float64)
    if b_crit_cis is not None and len(b_crit_cis):
        ci = np.asarray(b_crit_cis, dtype=np.float64).reshape(-1, 2)
        yerr = np.abs(np.stack([bc - ci[:, 0], ci[:, 1] - bc]))
        ax.errorbar(loss, bc, yerr=np.nan_to_num(yerr), fmt="o", color="C0", capsize=3,
                    label="fitted B_crit")
    else:
        ax.plot(loss, bc, "o", color="C0", label="fitted B_crit")
    finite_l = [loss[np.isfinite(loss)]]
    for i, (name, (m_losses, m_val)) in enumerate((measured or {}).items()):
        m_loss = np.asarray(m_losses, dtype=np.float64)
        ax.plot(m_loss, np.asarray(m_val, dtype=np.float64), "s--", color=f"C{i + 1}",
                mfc="none", label=f"measured {name}")
        finite_l.append(m_loss[np.isfinite(m_loss)])
    all_l = np.concatenate(finite_l)
    if power_law is not None and power_law.ok and all_l.size:
        grid = np.geomspace(all_l.min() * 0.9, all_l.max() * 1.1, 100)
        ax.plot(grid, power_law.b_crit(grid), "k-", lw=1,
                label=f"B*/L^(1/α_B): B* = {power_law.b_star:.3g}, α_B = {power_law.alpha_b:.3g}")
    ax.set(xlabel=xlabel, ylabel="batch size")
    if _finish(ax, logx=True, logy=True):
        ax.invert_xaxis()
    return save_figure(fig, path)


def noise_over_training(runs: Sequence[Mapping[str, Any]], path: PathLike, *,
                        x_key: str = "step", keys: Sequence[str] = ("b_simple", "b_noise"),
                        xlabel: str | None = None) -> str:
    """Noise scale over training, one colour per run label, one line style per key. runs:
    dicts with "label", `x_key` and any of `keys` (arrays; missing, misaligned, non-finite and
    non-positive values skipped). The legend goes beside the axes when it is long."""
    fig, (ax,) = _new()
    styles = ["-", "--", ":", "-."]
    labels = list(dict.fromkeys(str(run.get("label", i)) for i, run in enumerate(runs)))
    # the default cycle up to 10 labels, else a colour map: their order reads light to dark
    colors = ([f"C{k}" for k in range(len(labels))] if len(labels) <= 10 else
              [colormaps["viridis"](v) for v in np.linspace(0.0, 0.9, len(labels))])
    used_labels, used_keys = set(), set()
    for i, run in enumerate(runs):
        x = np.asarray(run.get(x_key, ()), dtype=np.float64)
        label = str(run.get("label", i))
        for j, key in enumerate(keys):
            y = np.asarray(run[key] if run.get(key) is not None else (), dtype=np.float64)
            if y.size == 0 or y.shape != x.shape:  # not measured, or not aligned with x
                continue
            keep = np.isfinite(x) & np.isfinite(y) & (y > 0)
            ax.plot(x[keep], y[keep], styles[j % len(styles)], lw=1,
                    color=colors[labels.index(label)])
            used_labels.add(label)
            used_keys.add(key)
    ax.set(xlabel=xlabel or x_key, ylabel="noise scale")
    if _finish(ax, logx=False, logy=True, legend=False):
        handles = [Line2D([], [], color=colors[k], label=lab)
                   for k, lab in enumerate(labels) if lab in used_labels]
        handles += [Line2D([], [], color="k", ls=styles[j % len(styles)], label=key)
                    for j, key in enumerate(keys) if key in used_keys]
        outside = len(handles) > 8
        ax.legend(handles=handles, fontsize=7 if outside else 8,
                  ncols=1 + len(handles) // 16 if outside else 1,
                  **({"loc": "upper left", "bbox_to_anchor": (1.01, 1.0)} if outside else {}))
    return save_figure(fig, path)


def se_plane(fit: TradeoffFit | None, path: PathLike, *,
             points: Mapping[str, Sequence[float]] | None = None,
             runs: Sequence[Mapping[str, Any]] = (),
             title: str = "Steps and examples to the target") -> str:
    """The S–E plane of one target: the fitted frontier, the sweep's points ({"batch_sizes",
    "steps"}) and extra runs ([{"label", "steps", "examples"}], e.g. batch ramps)."""
    fig, (ax,) = _new()
    b = np.asarray((points or {}).get("batch_sizes", ()), dtype=np.float64)
    s = np.asarray((points or {}).get("steps", ()), dtype=np.float64)
    if fit is not None and fit.ok:
        s_f, e_f = _frontier(fit, b)
        ax.plot(s_f, e_f, "k-", lw=1.2, label=f"fitted frontier (B_crit = {fit.b_crit:.3g})")
        ax.axvline(fit.s_min, color="0.6", ls=":", lw=1)
        ax.axhline(fit.e_min, color="0.6", ls=":", lw=1)
    if b.size:
        ax.plot(s, b * s, "o", color="0.5", label="fixed-batch sweep")
        for bi, si in zip(b, s, strict=True):
            ax.annotate(f"{bi:g}", (si, bi * si), fontsize=7, color="0.4",
                        xytext=(3, 3), textcoords="offset points")
    for i, run in enumerate(runs):
        if run.get("steps") is None or run.get("examples") is None:
            continue
        sx, ex = float(run["steps"]), float(run["examples"])
        if not (math.isfinite(sx) and math.isfinite(ex)):
            continue
        ax.plot([sx], [ex], "D", color=f"C{i % 10}", ms=8, mec="k", label=run.get("label"))
    ax.set(xlabel="steps S", ylabel="examples E", title=title)
    _finish(ax, logx=True, logy=True)
    return save_figure(fig, path)


def batch_size_schedule(runs: Sequence[Mapping[str, Any]], path: PathLike, *,
                        x_key: str = "examples_seen", xlabel: str = "examples seen") -> str:
    """Batch size (and "lr" where given, on a second axis) against `x_key` per run dict."""
    fig, (ax,) = _new()
    ax_lr = None
    for i, run in enumerate(runs):
        x = np.asarray(run[x_key], dtype=np.float64)
        ax.step(x, np.asarray(run["batch_size"], dtype=np.float64), where="post",
                color=f"C{i % 10}", label=f"{run.get('label', i)}: batch size")
        if run.get("lr") is not None:
            ax_lr = ax_lr or ax.twinx()
            ax_lr.step(x, np.asarray(run["lr"], dtype=np.float64), ":", where="post",
                        color=f"C{i % 10}")
    ax.set(xlabel=xlabel, ylabel="batch size")
    if ax_lr is not None:
        ax_lr.set_ylabel("learning rate (dotted)")
    _finish(ax, logx=False, logy=True)
    return save_figure(fig, path)
