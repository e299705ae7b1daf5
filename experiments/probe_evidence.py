"""Does the probe bring the held-out error down? The committed branch studies as probes.

    python -m experiments.probe_evidence --out=results/probe

Reads the committed branch studies and sweeps (nothing is trained) and writes
OUT/report.md and OUT/probe.json (`cbs.analysis.advice.probe_evidence`).
"""

from __future__ import annotations

import argparse
import json
import os

from cbs.analysis.advice import probe_evidence
from cbs.results import paths, records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/probe", help="directory for report.md, "
                        "probe.json")
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), help="the checkout whose results/ are read")
    args = parser.parse_args(argv)
    ev = probe_evidence.evidence(args.root)
    text = probe_evidence.markdown(ev)
    paths.makedirs(args.out)
    records.write_atomic(os.path.join(args.out, "report.md"), text + "\n")
    records.write_json_atomic(os.path.join(args.out, "probe.json"),
                              json.loads(json.dumps(ev, default=float)))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
