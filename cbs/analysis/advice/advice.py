"""How large should the batch be now? The calibrated answer from a measured noise scale
(docs/guides/advice.md).

From a noise scale B_s measured at the current parameters (B_simple, or B_noise with
curvature) and the optimizer, `advise` predicts B_crit with a prediction interval from the
calibration (`cbs.analysis.advice.calibration`, the shipped file unless one is given) and
says what the current batch B costs (McCandlish et al. 2018): S/S_min = 1 + B_crit/B,
E/E_min = 1 + B/B_crit, and, for an exchange rate λ (examples spent to save one step), the
batch √(λ·B_crit) that minimises λ·S + E. `trajectory` gives the advice at every measured
step of a run; each advice names its measurement and flags one from fewer than
`FEW_EXAMPLES` examples (one step's batch is noisier than the calibration's measurements).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cbs.analysis.advice import calibration
from cbs.analysis.fits import noise_at_target
from cbs.analysis.fits.fit import g3
from cbs.results import files, records
from cbs.results.calibration import family, predict, shipped, tradeoff
from cbs.results.store import SweepStore, target_key

__all__ = ["FEW_EXAMPLES", "Advice", "advise", "figure", "from_checkpoint", "from_stats",
           "from_sweep", "summary", "table", "trajectory"]

FEW_EXAMPLES = 512  # a noise scale measured on fewer examples is flagged as noisy


@dataclasses.dataclass(frozen=True)
class Advice:
    """The advice at one point: B_crit with its `level` prediction interval, S/S_min and
    E/E_min at batch_size, √(λ·B_crit) (None without λ), the measurement (`source`) and its
    examples (0: unknown), and the calibration's version, studies and ratio."""

    noise_scale: float
    scale: str
    optimizer: str
    batch_size: float
    b_crit: float
    interval: tuple[float, float]
    level: float
    steps_ratio: float
    examples_ratio: float
    best_batch_size: float | None
    source: str
    examples: int
    calibration: dict[str, Any]
    step: int | None = None
    loss: float | None = None
    outside: tuple[str, ...] = ()  # where the run lies outside the calibration (`edges`)

    @property
    def flags(self) -> list[str]:
        """What a reader should know before trusting the number."""
        out = [f"outside the calibration: {o}" for o in self.outside]
        if 0 < self.examples < FEW_EXAMPLES:
            out.append(f"noise scale from {self.examples} examples (< {FEW_EXAMPLES}): noisy")
        if not self.noise_scale > 0:
            out.append("noise scale not positive (|G|² estimate ≤ 0): no prediction")
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"flags": self.flags}


def advise(noise_scale: float, *, optimizer: str, batch_size: float, scale: str = "b_simple",
           level: float = 0.8, exchange: float | None = None, source: str = "given",
           examples: int = 0, calib: Mapping[str, Any] | None = None,
           step: int | None = None, loss: float | None = None, task: str | None = None,
           learning_rate: float | None = None) -> Advice:
    """The calibrated advice for one measured noise scale of kind `scale`. optimizer: the
    config's optim.name; exchange: λ; task ("data/model"), learning_rate (η_0) and loss place
    the run against the calibration (`calibration.edges`)."""
    calib = shipped() if calib is None else calib
    model = calib["models"].get(scale)
    if model is None:
        raise ValueError(f"the calibration has no {scale!r} model; it has "
                         f"{sorted(calib['models'])}")
    nan2 = (math.nan, math.nan)
    if noise_scale > 0 and math.isfinite(noise_scale):
        p = predict(model, noise_scale, optimizer, level=level)
        b_crit, interval, ratio = p["b_crit"], p["interval"], p["ratio"]
        t = tradeoff(batch_size, b_crit, exchange=exchange)
    else:
        b_crit, interval, ratio = math.nan, nan2, math.nan
        t = {"steps_ratio": math.nan, "examples_ratio": math.nan}
    loto = model.get("loto", {})
    about = {"version": calib["version"], "studies": len(calib["studies"]),
             "tasks": len(calib.get("tasks", ())), "family": family(optimizer),
             "ratio": ratio, "loto_coverage": loto.get("coverage"),
             "loto_points": loto.get("points"), "held_out": calib.get("held_out")}
    outside = calibration.edges(calib, optimizer=optimizer, batch_size=batch_size, task=task,
                                learning_rate=learning_rate, loss=loss, b_crit=b_crit)
    return Advice(float(noise_scale), scale, optimizer, float(batch_size), b_crit,
                  interval, level, t["steps_ratio"], t["examples_ratio"],
                  t.get("best_batch_size"), source, int(examples), about, step, loss,
                  tuple(outside))


def from_stats(stats: Any, *, optimizer: str, batch_size: float, scale: str = "b_simple",
               level: float = 0.8, exchange: float | None = None,
               calib: Mapping[str, Any] | None = None, step: int | None = None,
               loss: float | None = None) -> Advice:
    """The advice from anything with the attributes `scale` and `batch_size` (a `NoiseStats`)."""
    value = getattr(stats, scale, None)
    if value is None:
        raise ValueError(f"the statistics have no {scale}"
                         + (" (measure with curvature=True)" if scale == "b_noise" else ""))
    n = int(getattr(stats, "batch_size", 0) or 0)
    return advise(float(value), optimizer=optimizer, batch_size=batch_size, scale=scale,
                  level=level, exchange=exchange, source=f"measured in your code ({scale})",
                  examples=n, calib=calib, step=step, loss=loss)


def from_checkpoint(measured: Mapping[str, Any], *, scale: str = "b_simple",
                    level: float = 0.8, exchange: float | None = None,
                    calib: Mapping[str, Any] | None = None) -> Advice:
    """The advice from `cbs.train.measure_checkpoint`'s measurement of a saved state."""
    value = measured.get(f"noise/{scale}")
    if value is None:
        raise ValueError(f"the measurement has no {scale}"
                         + (" (measure with curvature)" if scale == "b_noise" else ""))
    n, total = int(measured["examples"]), int(measured["num_train"])
    where = ("exact measurement on all training examples" if n >= total else
             f"sampled measurement of {n} of {total} training examples")
    return advise(float(value), optimizer=str(measured["optimizer"]),
                  batch_size=float(measured["batch_size"]), scale=scale, level=level,
                  exchange=exchange, source=f"{where} at checkpoint {measured['step']}",
                  examples=n, calib=calib, step=int(measured["step"]),
                  loss=measured.get("full_train/loss"), task=measured.get("task"),
                  learning_rate=measured.get("learning_rate"))


def trajectory(run_dir: str, *, scale: str = "b_simple", level: float = 0.8,
               exchange: float | None = None, calib: Mapping[str, Any] | None = None
               ) -> list[Advice]:
    """The advice at every measured step of the run in `run_dir`: its measurement at each
    evaluation (`config.noise.examples`), else the periodic one of the step's batch
    (`noise.every`), else the live EMA `noise/ema_b_simple` at each evaluation."""
    config = records.read_json(os.path.join(run_dir, files.CONFIG_FILE))
    if config is None:
        raise ValueError(f"{run_dir} has no config.json: give a run directory "
                         "(cbs-train --workdir=...)")
    optimizer = str(config["optim"]["name"])
    run = _run_context(config)
    rows = records.read_records(os.path.join(run_dir, files.METRICS_FILE))
    losses = {int(r["step"]): float(r[k]) for r in rows for k in ("full_train/loss",)
              if r.get("kind") == "eval" and k in r}
    batches = {int(r["step"]): r["data/batch_size"] for r in rows if "data/batch_size" in r}
    noise_cfg = config.get("noise", {})
    at_eval = {"all": "exact measurement on all training examples at an evaluation",
               "stream": f"sampled measurement of {noise_cfg.get('batch_size', 0)} fresh "
                         "examples at an evaluation"}.get(str(noise_cfg.get("examples")))
    out = []
    for r in rows:
        step = int(r["step"])
        if r.get("kind") == "eval" and at_eval and f"noise/{scale}" in r:
            value, source = r[f"noise/{scale}"], at_eval
            n = int(noise_cfg.get("batch_size", 0)) if "sampled" in at_eval else 0
        elif r.get("kind") != "train" or at_eval:
            continue
        elif f"noise/{scale}" in r:
            value, source = r[f"noise/{scale}"], f"exact measurement ({scale})"
            n = int(r.get("noise/batch_size", 0))
        elif scale == "b_simple" and "noise/ema_b_simple" in r and step in losses:
            value, source = r["noise/ema_b_simple"], "live estimate (EMA of B_simple)"
            n = int(r.get("data/batch_size", 0))
        else:
            continue
        if value is None or math.isnan(float(value)):  # no estimate there (live "none")
            continue
        loss = losses.get(step, r.get("train/loss"))
        batch = (r.get("data/batch_size") or batches.get(step)
                 or config.get("batch", {}).get("schedule", {}).get("batch_size", 0) or math.nan)
        out.append(advise(float(value), optimizer=optimizer, scale=scale, level=level,
                          batch_size=float(batch), exchange=exchange, source=source,
                          examples=n, calib=calib, step=step,
                          loss=None if loss is None else float(loss), **run))
    return out


def _run_context(config: Mapping[str, Any]) -> dict[str, Any]:
    """The task ("data/model") and η_0 of a run's config, for `calibration.edges`."""
    names = [config.get(k, {}).get("name") for k in ("data", "model")]
    rate = config.get("optim", {}).get("learning_rate")
    return {"task": "/".join(names) if all(names) else None,
            "learning_rate": float(rate) if rate else None}


def from_sweep(sweep_dir: str, *, scale: str = "b_simple", level: float = 0.8,
               exchange: float | None = None, calib: Mapping[str, Any] | None = None
               ) -> list[Advice]:
    """The advice at each target of a sweep directory from the median noise scale its trials
    recorded at their crossings: for a one-run "sweep" (a config's `predict`) before the
    task's sweep."""
    store = SweepStore(sweep_dir)
    definition = store.definition() or {}
    config = definition.get("config", {})
    optimizer = str(config.get("optim", {}).get("name", "?"))
    examples, how = noise_at_target.examples_per_value(definition)
    run = _run_context(config)
    out = []
    for target in definition.get("sweep", {}).get("targets", []):
        key = target_key(float(target))
        crossed = [r for r in store.records()
                   if (r.get("noise_at_target", {}).get(key) or {}).get(scale) is not None]
        if not crossed:
            continue
        values = [float(r["noise_at_target"][key][scale]) for r in crossed]
        batch = [float(r["batch_size"]) for r in crossed]
        steps = [float(r["steps_to_target"][key]) for r in crossed]
        rates = [float(r["learning_rate"]) for r in crossed]
        i = int(np.argsort(values)[len(values) // 2])
        out.append(advise(values[i], optimizer=optimizer, scale=scale, level=level,
                          batch_size=batch[i], exchange=exchange,
                          source=f"{scale} at the crossing ({len(values)} trial(s); "
                                 f"{how})", examples=examples, calib=calib,
                          step=int(round(steps[i])), loss=float(target),
                          **(run | {"learning_rate": rates[i]})))
    return out


def summary(a: Advice) -> str:
    """The answer in three lines."""
    c = a.calibration
    where = "" if a.step is None else f" at step {a.step}"
    h = c.get("held_out")  # how often such an interval held on tasks predicted first
    held = (f"; on {h['tasks']} tasks predicted before their sweeps: {h['inside']} of "
            f"{h['points']} B_crit") if h else ""
    lines = [f"outside the calibration: {'; '.join(a.outside)}"] if a.outside else []
    lines += [f"{a.scale} = {g3(a.noise_scale)}{where} ({a.source}"
             + (f", {a.examples} examples" if a.examples else "") + ")",
             f"predicted B_crit = {g3(a.b_crit)} ({a.level:.0%} interval {g3(a.interval[0])}–"
             f"{g3(a.interval[1])}; calibration v{c['version']}, {c['studies']} studies of "
             f"{c['tasks']} tasks, {c['family']} optimizers: B_crit ≈ {g3(c['ratio'])} × "
             f"{a.scale})",
             f"interval held on tasks left out of the calibration: "
             f"{g3(100 * (c.get('loto_coverage') or math.nan))} % of {c.get('loto_points')} "
             f"one-run noise scales" + held,
             f"batch {g3(a.batch_size)}: {g3(a.steps_ratio)}× the fewest steps, "
             f"{g3(a.examples_ratio)}× the fewest examples"
             + ("" if a.best_batch_size is None else
                f"; the batch that minimises λ·S + E is {g3(a.best_batch_size)}")]
    return "\n".join(lines + [f"note: {f}" for f in a.flags if not f.startswith("outside")])


def table(advices: Sequence[Advice]) -> str:
    """Markdown: the advice at every measured step."""
    lines = ["| step | loss | noise scale | predicted B_crit (interval) | S/S_min | E/E_min "
             "| outside the calibration |", "|---|---|---|---|---|---|---|"]
    short = {"learning": "rate", "loss": "loss", "task": "task", "predicted": "B_crit < 1"}
    for a in advices:
        outside = ", ".join(short.get(o.split(" ")[0], o) for o in a.outside) or "–"
        lines.append(f"| {a.step} | {g3(a.loss)} | {g3(a.noise_scale)} | {g3(a.b_crit)} "
                     f"({g3(a.interval[0])}–{g3(a.interval[1])}) | {g3(a.steps_ratio)} | "
                     f"{g3(a.examples_ratio)} | {outside} |")
    return "\n".join(lines)


def figure(advices: Sequence[Advice], path: str) -> str:
    """Predicted B_crit with its interval and the batch used, against the step."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4))
    ax = fig.add_subplot()
    pts = [a for a in advices if math.isfinite(a.b_crit)]
    steps = [int(a.step or 0) for a in pts]
    ax.fill_between(steps, [a.interval[0] for a in pts], [a.interval[1] for a in pts],
                    alpha=0.25, label=f"{pts[0].level:.0%} interval" if pts else None)
    ax.plot(steps, [a.b_crit for a in pts], "o-", ms=3, label="predicted B_crit")
    ax.plot(steps, [a.batch_size for a in pts], "k--", lw=1, label="batch size used")
    ax.set(yscale="log", xlabel="step", ylabel="examples")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    from cbs.analysis.reports import plots

    return plots.save_figure(fig, path, dpi=110)
