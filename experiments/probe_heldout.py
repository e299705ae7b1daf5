"""The probe on the held-out tasks: cross-task advice, probed advice and the sweep's B_crit.

    python -m experiments.probe_heldout --out=results/probe_heldout --work=/tmp/probe_heldout

For each held-out task with a cheap one-run prediction (`heldout_sweep:digits_cnn`,
`:mnist1d_cnn`, `:regression`, `teacher_student_sweep`): trains the predict run's
configuration as a plain run (`cbs-train`: B = 64 at the grid's centre rate, to just past the
step where the committed prediction run crossed the deepest target), then asks `cbs-advise
--probe` at its last checkpoint with the default budget (10 % of the run's examples) and, where
that budget fits no step of the ladder, again with the whole run's examples (`--probe_budget=1`).
The table puts the cross-task prediction and the probed one beside the B_crit the committed
sweep measured at that target. The runs are not the committed prediction runs (those are sweep
groups, whose checkpoints a plain run cannot restore) but the same configuration, seed and
rate; their noise scale is measured again at the checkpoint. The depth-4 LM is left out (its
one run takes hours here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app, flags


def _define_flags() -> None:
    """--out and --work, defined when run as a command only (the tests import `_markdown`
    beside other commands that define --out)."""
    flags.DEFINE_string("out", "results/probe_heldout", "Where report.md and "
                        "probe_heldout.json go.")
    flags.DEFINE_string("work", "/tmp/probe_heldout", "Where the runs and probes go.")


# (name, preset, centre rate at B = 64, steps, deepest target, the sweep that measured it)
TASKS = (
    ("digits_cnn", "heldout_sweep:digits_cnn", 4e-3, 190, 0.05, "results/heldout_digits_cnn"),
    ("mnist1d_cnn", "heldout_sweep:mnist1d_cnn", 3e-3, 416, 0.15,
     "results/heldout_mnist1d_cnn"),
    ("regression", "heldout_sweep:regression", 0.05, 7040, 0.02, "results/heldout_regression"),
    ("teacher_student", "teacher_student_sweep", 2e-3, 1585, 0.2,
     "results/heldout_teacher_student"),
)


def _module(name: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", name, *args], capture_output=True, text=True,
                          check=False)


def _measured(sweep_dir: str, target: float) -> dict:
    with open(os.path.join(sweep_dir, "analysis.json"), encoding="utf-8") as f:
        analysis = json.load(f)
    t = next(t for t in analysis["targets"] if float(t["target"]) == target)
    return {"b_crit": t["fit"]["b_crit"], "interval": t["fit"].get("b_crit_ci")}


def _probe(workdir: str, steps: int, budget: float) -> dict:
    done = _module("cbs.commands.advise", [f"--workdir={workdir}", "--probe",
                                           f"--probe_budget={budget}"])
    if done.returncode:
        return {"budget": budget, "refused": done.stderr.strip().splitlines()[-1]}
    with open(os.path.join(workdir, f"advice_{steps}.json"), encoding="utf-8") as f:
        probe = json.load(f)["probe"]
    c = probe["combined"]
    return {"budget": budget, "cross_task": c["cross_task"], "probed": c["probed"],
            "local_now": c["local_now"], "weight": c["weight"], "cost": probe["cost"]}


def _row(work, name, preset, lr, steps, target, sweep_dir) -> dict:
    workdir = os.path.join(work, name)
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        done = _module("cbs.commands.train", [
            f"--config={preset}", f"--config.optim.learning_rate={lr}",
            "--config.batch.schedule.batch_size=64", "--config.batch.micro_batch=64",
            f"--config.train.max_steps={steps}", f"--config.train.checkpoint_every={steps}",
            "--config.noise.every=0", f"--workdir={workdir}"])
        if done.returncode:
            raise RuntimeError(f"{name}: cbs-train failed: {done.stderr[-2000:]}")
    probes = [_probe(workdir, steps, 0.1)]
    if "refused" in probes[0]:
        probes.append(_probe(workdir, steps, 1.0))
    return {"task": name, "preset": preset, "learning_rate": lr, "step": steps,
            "target": target, "measured": _measured(sweep_dir, target), "probes": probes}


def _markdown(rows: list[dict]) -> str:
    lines = ["# The probe on the held-out tasks", "",
             "`python -m experiments.probe_heldout` (module docstring): one plain run per task "
             "at B = 64, probed at its last checkpoint (the deepest target's crossing); the "
             "fixed-batch B_crit predicted there against the sweep's B_crit at that target.", "",
             "| task | target L | budget | cross-task (80 %) | probed (80 %) | local B_crit now | "
             "probe's weight | probe cost | measured B_crit (95 %) |",
             "|---|---|---|---|---|---|---|---|---|"]
    g = lambda x: f"{x:.3g}"  # noqa: E731
    for r in rows:
        m = r["measured"]
        ci = f" ({g(m['interval'][0])}–{g(m['interval'][1])})" if m.get("interval") else ""
        for p in r["probes"]:
            if "refused" in p:
                lines.append(f"| {r['task']} | {r['target']} | {p['budget']:.0%} | refused: "
                             f"{p['refused']} | | | | | {g(m['b_crit'])}{ci} |")
                continue
            c, q, loc = p["cross_task"], p["probed"], p["local_now"]
            lines.append(
                f"| {r['task']} | {r['target']} | {p['budget']:.0%} | {g(c['b_crit'])} "
                f"({g(c['interval'][0])}–{g(c['interval'][1])}) | {g(q['b_crit'])} "
                f"({g(q['interval'][0])}–{g(q['interval'][1])}) | {g(loc['b_crit'])} | "
                f"{p['weight']:.2f} | {p['cost']['fraction_examples']:.0%} of the run's "
                f"examples | {g(m['b_crit'])}{ci} |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    out = flags.FLAGS.out
    rows = [_row(flags.FLAGS.work, *t) for t in TASKS]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "probe_heldout.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write(_markdown(rows))
    print(_markdown(rows))


if __name__ == "__main__":
    _define_flags()
    app.run(main)
