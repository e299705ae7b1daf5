"""Does the probe bring the held-out error down? The committed branch studies as probes
(`python -m experiments.probe_evidence --out=results/probe`; docs/guides/advice.md).

Each branch point of a committed branch study (STUDIES) is a probe (`probe.local_ratio` with
the study's own rule) with the noise scale B_s there: the exact B_simple of the study's
`reference_noise.jsonl`, else the run's live EMA of B_simple at that step. Predicted: the
swept B_crit at each target of the task's committed sweep (extrapolated ones left out) from
B_simple of the sweep's best trial at batch B, three ways: cross-task (the calibration
refitted WITHOUT the task), probed (`probe.combine`) and probe alone (log B_s + y). Error:
|log(prediction / measured)|, over every (probe point, target) pair and over the pairs whose
point lies nearest the reference's crossing of the target.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cbs.analysis.advice import calibration, probe
from cbs.analysis.reports import branch_report
from cbs.results import files, records, shared
from cbs.results.calibration import family, shipped

__all__ = ["STUDIES", "evidence", "markdown", "study"]

# (branch study, the task's sweep as named in the calibration, task), under results/
STUDIES = (("digits_branch", "digits", "digits/mlp"),
           ("shakespeare_branch", "shakespeare_char", "shakespeare_char/transformer"))


def _point_noise(branch_dir: str, steps: Sequence[int]) -> tuple[dict[int, float], str]:
    """B_s at each branch point and its source."""
    noise = shared.read_merged(os.path.join(branch_dir, files.REFERENCE_NOISE_FILE),
                                files.REFERENCE_POINT_KEYS)
    if noise:
        by = {int(r["step"]): float(r["noise/b_simple"]) for r in noise}
        return {s: by.get(s, math.nan) for s in steps}, "exact B_simple on all training examples"
    recs = records.read_records(os.path.join(branch_dir, branch_report.REFERENCE_METRICS))
    ema = {int(r["step"]): r.get("noise/ema_b_simple") for r in recs if r.get("kind") == "train"}
    return ({s: float(ema.get(s) or math.nan) for s in steps},
            "the run's live EMA of B_simple at that step")


def _crossings(branch_dir: str, targets: Sequence[float]) -> dict[float, float]:
    """Examples at which the reference's full training-set (else eval) loss reaches each target."""
    recs = [r for r in records.read_records(os.path.join(branch_dir,
                                                         branch_report.REFERENCE_METRICS))
            if r.get("kind") == "eval"]
    key = "full_train/loss" if any("full_train/loss" in r for r in recs) else "eval/loss"
    hits = {t: [r for r in recs if r.get(key) is not None and float(r[key]) <= t] for t in targets}
    return {t: float(h[0]["data/examples_seen"]) for t, h in hits.items() if h}


def study(root: str, branch: str, sweep: str, task: str,
          calib: Mapping[str, Any], *, level: float = 0.8) -> dict[str, Any]:
    """The evidence of one branch study."""
    branch_dir = os.path.join(root, "results", branch)
    d = records.read_json(os.path.join(branch_dir, files.DEFINITION_FILE))
    if d is None:
        raise ValueError(f"{branch_dir}: no {files.DEFINITION_FILE} (a branch study's definition)")
    b, bsz = d["branch"], int(d["reference_batch_size"])
    rows = shared.read_merged(os.path.join(branch_dir, files.BRANCHES_FILE),
                               ("point_step", "k", "seed"))
    steps = sorted({int(r["point_step"]) for r in rows})
    noise, source = _point_noise(branch_dir, steps)
    rule = {"epsilon": b["epsilon"], "tolerance": b["tolerance"], "metric": b["metric"],
            "criterion": b.get("criterion", "ladder")}
    prior = calibration.model([p for p in calib["points"] if p.get("task") != task], "b_simple")
    optimizer = str(d["optimizer"])
    points: list[dict[str, Any]] = []
    base, ks = probe.ladder(bsz)  # `cbs-advise --probe`'s defaults: B/2 ... 8B, 2 seeds, 10 %
    for s in steps:
        pr = [r for r in rows if r["point_step"] == s]
        ratio = probe.local_ratio(pr, noise[s], **rule)
        spent = probe.cost(pr)
        e0 = int(pr[0]["point_examples"])
        try:
            at_budget = probe.plan(examples_seen=e0, steps_seen=s, base=base, ks=ks,
                                   seeds=2)["window"]
        except ValueError:  # not one step of 8B fits
            at_budget = 0
        points.append({"step": s, "examples": e0, "ratio": ratio, "cost": spent,
                       "fraction_examples": spent["examples"] / e0,
                       "fraction_steps": spent["steps"] / s,
                       "window": int(pr[0]["window_examples"]),
                       "window_at_10pc": at_budget})
    targets = [p for p in calib["points"] if p["study"] == sweep and not p.get("extrapolated")]
    cross = _crossings(branch_dir, [float(p["target"]) for p in targets])
    pairs = []
    for t in targets:
        b_s = float((t.get("b_simple_by_batch_size") or {}).get(str(bsz), math.nan))
        for p in points:
            if p["ratio"]["bound"] or not math.isfinite(p["ratio"]["log_ratio"]):
                continue
            ratio = p["ratio"] | {"noise_scale": b_s}
            c = probe.combine(prior, optimizer, ratio, level=level)
            measured = float(t["b_crit"])
            err = {k: abs(math.log(c[k]["b_crit"] / measured)) for k in ("cross_task", "probed")}
            inside = {k: c[k]["interval"][0] <= measured <= c[k]["interval"][1]
                      for k in ("cross_task", "probed")}
            alone = abs(math.log(b_s * math.exp(p["ratio"]["log_ratio"]) / measured))
            pairs.append({"target": float(t["target"]), "b_crit": measured, "b_simple": b_s,
                          "point_examples": p["examples"], "b_star": p["ratio"]["b_star"],
                          "crossing": cross.get(float(t["target"])),
                          "cross_task": c["cross_task"]["b_crit"], "probed": c["probed"]["b_crit"],
                          "probe_alone": b_s * math.exp(p["ratio"]["log_ratio"]),
                          "error_cross_task": err["cross_task"], "error_probed": err["probed"],
                          "error_probe_alone": alone, "inside_cross_task": inside["cross_task"],
                          "inside_probed": inside["probed"], "weight": c["weight"]})
    return {"branch": branch, "sweep": sweep, "task": task, "optimizer": optimizer,
            "reference_batch_size": bsz, "noise_source": source, "rule": rule,
            "prior": {"mu": prior["families"][family(optimizer)]["mu"],
                      "tasks_left": sorted({str(p.get("task")) for p in calib["points"]
                                            if p.get("task") != task})},
            "points": points, "pairs": pairs, "nearest": _nearest(pairs)}


def _nearest(pairs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per target, the pair whose probe point is nearest the reference's crossing."""
    out = []
    for t in sorted({p["target"] for p in pairs}, reverse=True):
        mine = [p for p in pairs if p["target"] == t and p["crossing"]]
        if mine:
            out.append(dict(min(mine, key=lambda p: abs(math.log(p["point_examples"]
                                                                 / p["crossing"])))))
    return out


def _errors(pairs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Median and mean |log error| per prediction, how often the probe lowered it, coverage."""
    out: dict[str, Any] = {"pairs": len(pairs)}
    if not pairs:
        return out
    for k in ("cross_task", "probed", "probe_alone"):
        e = np.asarray([p[f"error_{k}"] for p in pairs])
        out[k] = {"median": float(np.median(e)), "mean": float(np.mean(e)),
                  "median_factor": float(np.exp(np.median(e)))}
    out["probe_lower"] = int(sum(p["error_probed"] < p["error_cross_task"] for p in pairs))
    out["inside_cross_task"] = int(sum(p["inside_cross_task"] for p in pairs))
    out["inside_probed"] = int(sum(p["inside_probed"] for p in pairs))
    return out


def evidence(root: str, calib: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every study of STUDIES, with the error summaries over all pairs and nearest pairs."""
    calib = shipped() if calib is None else calib
    studies = [study(root, *s, calib) for s in STUDIES]
    for s in studies:
        s["summary"] = {"all": _errors(s["pairs"]), "nearest": _errors(s["nearest"])}
    pooled = [p for s in studies for p in s["pairs"]]
    nearest = [p for s in studies for p in s["nearest"]]
    return {"calibration_version": calib["version"], "level": 0.8, "studies": studies,
            "summary": {"all": _errors(pooled), "nearest": _errors(nearest)}}


_g = "{:.3g}".format


def markdown(ev: Mapping[str, Any]) -> str:
    """The evidence as a report."""
    lines = ["# Does the probe bring the held-out error down?", "",
             "Generated by `python -m experiments.probe_evidence --out=results/probe` from the "
             "committed branch studies and sweeps (nothing is trained). Module docstring of "
             "`cbs.analysis.advice.probe_evidence`: each branch point of a committed study is a "
             "probe; the prediction is the task's swept B_crit at each target from the sweep's "
             "one-run B_simple at the reference's batch; the prior is the calibration "
             f"(v{ev['calibration_version']}) refitted without the task. Error = "
             "|log(prediction/measured)|; ×/÷ factor = exp(median error).", ""]
    for s in [*ev["studies"], None]:
        summ = ev["summary"] if s is None else s["summary"]
        name = "Both studies pooled" if s is None else (
            f"{s['branch']} → {s['sweep']} ({s['optimizer']}, B = "
            f"{s['reference_batch_size']}; B_s at the probe: {s['noise_source']}; prior "
            f"ratio {math.exp(s['prior']['mu']):.3g} from {', '.join(s['prior']['tasks_left'])})")
        lines += [f"## {name}", "", "| pairs | n | cross-task ×/÷ (median) | probed ×/÷ | probe "
                  "alone ×/÷ | probe lowered the error | inside 80 % (cross-task / probed) |",
                  "|---|---|---|---|---|---|---|"]
        for which in ("all", "nearest"):
            e = summ[which]
            if not e["pairs"]:
                lines.append(f"| {which} | 0 | – | – | – | – | – |")
                continue
            lines.append(f"| {which} | {e['pairs']} | {_g(e['cross_task']['median_factor'])} | "
                         f"{_g(e['probed']['median_factor'])} | "
                         f"{_g(e['probe_alone']['median_factor'])} | {e['probe_lower']} of "
                         f"{e['pairs']} | {e['inside_cross_task']} / {e['inside_probed']} |")
        lines.append("")
        if s is None:
            continue
        lines += ["| probe at (examples) | B* bracket | B_s | ratio B*/B_s (log se) | cost: "
                  "examples (× run so far) | steps (× run so far) | window Δ | Δ of the "
                  "defaults (10 %) |", "|---|---|---|---|---|---|---|---|"]
        for p in s["points"]:
            r = p["ratio"]
            ratio = (f"{r['bound']} (bound)" if r["bound"] else
                     f"{math.exp(r['log_ratio']):.3g} ({r['se']:.2f})")
            lines.append(f"| {p['examples']} | {r['b_pass']:.0f}–{r['b_fail']:.0f} | "
                         f"{_g(r['noise_scale'])} | {ratio} | {p['cost']['examples']} "
                         f"({p['fraction_examples']:.3g}) | {p['cost']['steps']} "
                         f"({p['fraction_steps']:.3g}) | {p['window']} | "
                         f"{p['window_at_10pc'] or 'not one step'} |")
        lines += ["", "| target | swept B_crit | B_s (sweep, B) | nearest probe (examples) | "
                  "its B* | cross-task | probed | probe alone |", "|---" * 8 + "|"]
        for p in s["nearest"]:
            lines.append(f"| {p['target']:g} | {_g(p['b_crit'])} | {_g(p['b_simple'])} | "
                         f"{p['point_examples']} | {_g(p['b_star'])} | "
                         f"{_g(p['cross_task'])} | {_g(p['probed'])} | {_g(p['probe_alone'])} |")
        lines.append("")
    return "\n".join(lines)
