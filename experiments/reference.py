"""One noise protocol for a committed study: the reference trajectory over seeds.

    python -m experiments.reference --sweep_dir=results/digits --seeds=3

Runs, for seeds 0 … seeds − 1 (the seed sets initialisation and data order), the reference
trajectory at the largest of the study's batch sizes B ≤ B_crit/4 (B_crit: the study's fit
at its lowest target), at the best learning rate at B, measured on the whole training set
with the full-data Hessian and 256 deviations at each evaluation past the first target, and
for Adam/AdamW also the noise scale of the update applied (`cbs.sweeps.reference_seeds`).
Writes SWEEP_DIR/reference_seeds/seed_<k>.jsonl once per seed (existing seeds are skipped)
and prints each seed's noise scale at each target and the spread over seeds
(`cbs.analysis.studies.reference_protocol`); `cbs-compare` puts them on the cross-task figure.
SWEEP_DIR may be on an object store (gs://). A bad input (no study there, a bad flag value)
is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from cbs.analysis.studies import reference_protocol
from cbs.runtime import cli
from cbs.sweeps import reference_seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep_dir", required=True, help="a committed study")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 … seeds − 1")
    parser.add_argument("--deviations", type=int, default=None,
                        help="random deviations of tr(HΣ) per measurement (whole training "
                             f"set: >= {reference_seeds.DEVIATIONS}, its default; sampled: "
                             f"default {reference_seeds.SAMPLED_DEVIATIONS})")
    parser.add_argument("--examples", type=int, default=0,
                        help="n > 0: the sampled protocol, n examples per measurement at the "
                             "window of evaluations from each target's crossing (0: the whole "
                             "training set at every evaluation past the first crossing)")
    parser.add_argument("--hessian_examples", type=int,
                        default=reference_seeds.HESSIAN_EXAMPLES,
                        help="h of the sampled protocol: examples of the independent Hessian")
    parser.add_argument("--fraction", type=float, default=reference_seeds.FRACTION,
                        help="B <= B_crit / fraction at the lowest target")
    parser.add_argument("--evals", type=int, default=0,
                        help="log-spaced evaluations over the budget (0: the sweep's "
                             "noise_reference_evals)")
    parser.add_argument("--batch_size", type=int, default=0,
                        help="B (0: the largest batch size <= B_crit / fraction)")
    args = parser.parse_args(argv)
    reference_seeds.run_seeds(args.sweep_dir, seeds=args.seeds, deviations=args.deviations,
                              fraction=args.fraction, evals=args.evals or None,
                              batch_size=args.batch_size, examples=args.examples,
                              hessian_examples=args.hessian_examples)
    summary = reference_protocol.load(args.sweep_dir)
    if summary is not None:
        print(reference_protocol.markdown(summary))
    return 0


if __name__ == "__main__":
    cli.guarded(lambda argv: main(argv[1:]))(sys.argv)  # user errors: one line, status 2
