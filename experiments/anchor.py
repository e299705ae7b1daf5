"""The linear-regression anchor in closed form, beside the committed sweep.

    python -m experiments.anchor --sweep_dir=results/linreg_sgd --out=results/linreg_anchor

Reads the sweep's config (`sweep.json`: data, targets) and the learning rates it tried at each
batch size (`trials.jsonl`), computes the exact expected loss of SGD on the same Gaussian
problem (`cbs.analysis.fits.anchor`) under the sweep's constant-rate grid (its batch sizes, batches
drawn without replacement from N) and under the per-step optimal rate (fresh examples, batch
sizes 8 … 2^20 so that the fit brackets B_crit), and writes
`anchor.json` and `report.md` to `--out`: per target, B_crit of each protocol, the path-average
B_noise, and B_noise and B_simple where the runs cross the target, beside the sweep's fitted
B_crit and measured noise scales. Training-set targets are mapped to population ones by their
excess over the training minimum (σ²/2 + L − L_min(train)). About 30 s on one core.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os

import numpy as np

from cbs import data
from cbs.analysis.fits import anchor
from cbs.analysis.reports import report
from cbs.results import records
from cbs.results.store import SweepStore


def _training_minimum(ds: data.Dataset) -> float:
    """The least-squares training loss ½·mean(r²) of the model with bias (float64)."""
    x = np.asarray(ds.train["x"], np.float64)
    y = np.asarray(ds.train["y"], np.float64)
    xt = np.c_[x, np.ones(len(y))]
    theta = np.linalg.lstsq(xt, y, rcond=None)[0]
    return float(0.5 * np.mean((xt @ theta - y) ** 2))


def study(sweep_dir: str, *, steps: int = 50_000) -> dict:
    """The closed-form anchor for the sweep in `sweep_dir` (a linreg SGD sweep)."""
    config = SweepStore(sweep_dir).definition()["config"]
    options = config["data"]["options"]
    ds = data.get_dataset("linreg", **options)
    meta = ds.metadata
    dim = int(options["dim"])
    problem = anchor.LinregProblem.from_dataset(
        meta["cov"], meta["w_star"], meta["noise_std"], init_variance=1.0 / dim,
        num_train=int(options["num_train"]))
    rates: dict[float, set] = collections.defaultdict(set)
    for r in records.read_records(os.path.join(sweep_dir, "trials.jsonl")):
        rates[float(r["batch_size"])].add(float(r["learning_rate"]))
    train_min = _training_minimum(ds)
    targets = [float(t) for t in config["sweep"]["targets"]]
    population = [problem.min_loss + (t - train_min) for t in targets]
    grid = anchor.grid_study(problem, {b: sorted(v) for b, v in rates.items()}, population,
                             steps=steps)
    fresh = dataclasses.replace(problem, num_train=0)
    optimal = anchor.optimal_study(fresh, [2.0**k for k in range(3, 21)], population,
                                   steps=steps)
    measured = report.analyze(sweep_dir, write=False)["targets"]
    rows = []
    for k, (t, m) in enumerate(zip(targets, measured, strict=True)):
        opt, g = optimal[k], grid[k]
        rows.append({
            "target": t, "population_target": population[k],
            "sweep_b_crit": m["fit"]["b_crit"], "sweep_b_crit_ci": m["fit"]["b_crit_ci"],
            "sweep_b_noise": m.get("measured_b_noise"),
            "sweep_b_simple": m.get("measured_b_simple"),
            "grid_b_crit": g["b_crit"], "grid_b_noise": g["b_noise"],
            "grid_b_noise_range": g["b_noise_range"], "grid_b_simple": g["b_simple"],
            "grid_steps": g["steps"], "sweep_steps": m.get("steps"),
            "grid_best_lr": g["best_lr"], "sweep_best_lr": m.get("learning_rates"),
            "optimal_b_crit": opt["b_crit"], "optimal_b_noise": opt["b_noise"],
            "optimal_b_simple": opt["b_simple"], "path_b_noise": opt["path_b_noise"]})
    return {"sweep_dir": sweep_dir, "training_minimum": train_min,
            "population_minimum": problem.min_loss, "steps": steps,
            "batch_sizes": grid[0]["batch_sizes"],
            "optimal_batch_sizes": optimal[0]["batch_sizes"], "rows": rows,
            "closed_form": {"grid": grid, "optimal": optimal}}


def _g(x) -> str:
    return "–" if x is None or not math.isfinite(float(x)) else f"{float(x):.3g}"


def markdown(result: dict) -> str:
    """The report: one table, B_crit and noise scales per target under each protocol."""
    head = ("| target L (train) | sweep B_crit (95% CI) | sweep B_noise | closed form, sweep's "
            "grid: B_crit | B_noise at crossing | B_crit / B_noise | closed form, optimal "
            "rate: B_crit | path-average B_noise | B_crit / path B_noise | B_noise at crossing "
            "|\n|" + "---|" * 10)
    lines = [head]
    for r in result["rows"]:
        ci = r["sweep_b_crit_ci"] or [None, None]
        lines.append(
            f"| {r['target']:g} | {_g(r['sweep_b_crit'])} ({_g(ci[0])}–{_g(ci[1])}) | "
            f"{_g(r['sweep_b_noise'])} | {_g(r['grid_b_crit'])} | {_g(r['grid_b_noise'])} | "
            f"{_g(r['grid_b_crit'] / r['grid_b_noise'])} | {_g(r['optimal_b_crit'])} | "
            f"{_g(r['path_b_noise'])} | {_g(r['optimal_b_crit'] / r['path_b_noise'])} | "
            f"{_g(r['optimal_b_noise'])} |")
    return (f"# The linear-regression anchor in closed form: `{result['sweep_dir']}`\n\n"
            "Exact expected loss of SGD on the sweep's Gaussian problem (second-moment "
            "recursion, `cbs.analysis.fits.anchor`), targets "
            f"mapped by their excess over the training minimum ({result['training_minimum']:.5f}"
            f" → population {result['population_minimum']:.5f}). \"Sweep's grid\": the best "
            "constant rate per batch size among the rates the sweep tried (batches without "
            "replacement from N); \"optimal rate\": "
            "the rate minimising the next expected loss at every step (fresh examples, B = 8 … "
            "2^20). B_crit is the least-squares fit of S = S_min + E_min/B; B_noise at "
            "crossing is the median over batch sizes where each protocol's runs cross the "
            "target; the path average is over the updates of the B → ∞ optimal path.\n\n"
            + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep_dir", default="results/linreg_sgd", help="a linreg SGD sweep")
    parser.add_argument("--out", default="results/linreg_anchor", help="output directory")
    parser.add_argument("--steps", type=int, default=50_000, help="most updates per run")
    args = parser.parse_args(argv)
    result = study(args.sweep_dir, steps=args.steps)
    os.makedirs(args.out, exist_ok=True)
    records.write_json_atomic(os.path.join(args.out, "anchor.json"), _plain(result))
    text = markdown(result)
    records.write_atomic(os.path.join(args.out, "report.md"), text)
    print(text)
    return 0


def _plain(x):
    return json.loads(json.dumps(x, default=float, allow_nan=True).replace("NaN", "null")
                      .replace("Infinity", "null"))


if __name__ == "__main__":
    raise SystemExit(main())
