"""Every path's noise records, for comparing two versions of cbs bit for bit.

    python -m benchmarks.noise_records --out=/tmp/before.json
    python -m benchmarks.noise_records --out=/tmp/after.json --compare=/tmp/before.json

Runs tiny studies from the committed configs through the command-line entry points (one
process each): a single run measuring every 5 steps with curvature (method "auto": exact,
deviations and H from the two halves of its batch) and one with method "sampled"; the tiny
digits sweep as vmapped groups measuring on the whole training set, with its reference run;
the same sweep measuring on batches of a fresh stream, as vmapped groups and as engine trials;
and the tiny digits branch study with its whole-training-set reference noise. It collects every
`noise/*` number of their records (metrics.jsonl, trials.jsonl, reference_noise.jsonl, under
any key path) into one JSON file; `--compare` reports the numbers that differ (exit status 1
if any). A few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from typing import Any

DIGITS_SWEEP = "experiments/configs/digits_sweep.py:tiny"


def _sweep_flags(examples: str) -> list[str]:
    """Flags selecting which examples a sweep measures, in either config layout (before the
    measurement settings moved from config.sweep.noise_* to config.noise.*)."""
    from cbs.sweeps.grid import default_sweep_config
    if "noise_examples" in default_sweep_config():
        return [f"--config.sweep.noise_examples={'sampled' if examples == 'stream' else 'all'}"]
    return [f"--config.noise.examples={examples}"]


def studies() -> dict[str, list[str]]:
    """name -> command-line arguments of `python -m`."""
    single = ["experiments.main", "--config=experiments/configs/digits_mlp.py:tiny",
              "--config.noise.every=5", "--config.noise.curvature=True"]
    sweep = ["experiments.sweep", f"--config={DIGITS_SWEEP}", "--noanalyze"]
    return {
        "single_auto": single,
        "single_sampled": single + ["--config.noise.method=sampled"],
        "sweep_all_vmap": sweep + _sweep_flags("all") + [
            "--config.sweep.noise_protocol=reference"],
        "sweep_stream_vmap": sweep + _sweep_flags("stream"),
        "sweep_stream_engine": sweep + _sweep_flags("stream") + [
            "--config.sweep.vmap_trials=False"],
        "branch": ["experiments.branch", "--config=experiments/configs/digits_branch.py:tiny",
                   "--noreport"],
    }


def _dir_flag(args: list[str]) -> str:
    return {"experiments.main": "--workdir", "experiments.sweep": "--sweep_dir",
            "experiments.branch": "--workdir"}[args[0]]


def _collect(tree: Any, path: str, out: dict[str, float]) -> None:
    """Every number under a `noise/...` key of `tree`, keyed by its path."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            _collect(v, f"{path}/{k}", out)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            _collect(v, f"{path}[{i}]", out)
    elif "noise/" in path and isinstance(tree, (int, float)) and not isinstance(tree, bool):
        out[path] = float(tree)


def noise_numbers(root: str) -> dict[str, float]:
    """{file path:line/key path: value} of every noise number in the jsonl files under root."""
    out: dict[str, float] = {}
    for dirpath, _, names in sorted(os.walk(root)):
        for name in sorted(names):
            if not name.endswith(".jsonl"):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                for i, line in enumerate(f):
                    rec = json.loads(line)
                    for k in ("seconds", "wall_time", "time"):
                        rec.pop(k, None)
                    _collect(rec, f"{os.path.relpath(path, root)}:{i}", out)
    return out


def run_all(workdir: str) -> dict[str, dict[str, float]]:
    result = {}
    for name, args in studies().items():
        d = os.path.join(workdir, name)
        cmd = [sys.executable, "-m", *args, f"{_dir_flag(args)}={d}"]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result[name] = noise_numbers(d)
        print(f"  {len(result[name])} noise numbers", flush=True)
    return result


def compare(new: dict[str, dict[str, float]], old: dict[str, dict[str, float]]) -> int:
    """Prints the differences; returns how many numbers differ (missing ones included)."""
    bad = 0
    for study in sorted(set(old) | set(new)):
        a, b = old.get(study, {}), new.get(study, {})
        diff = [k for k in sorted(set(a) | set(b))
                if k not in a or k not in b
                or not (a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])))]
        print(f"{study}: {len(b)} numbers, {len(diff)} differ")
        for k in diff[:10]:
            print(f"  {k}: {a.get(k)} -> {b.get(k)}")
        bad += len(diff)
    return bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--compare", default=None)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="noise_records_")
    result = run_all(workdir)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=0, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            sys.exit(1 if compare(result, json.load(f)) else 0)


if __name__ == "__main__":
    main()
