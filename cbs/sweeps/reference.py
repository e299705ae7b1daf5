"""The reference-trajectory noise protocol (McCandlish et al. 2018): one run, measured densely.

After a sweep, its best trial at B_ref (`sweep.noise_reference_batch_size`; `reference_trial`)
runs again as a vmapped group of one (`cbs.sweeps.groups.TrialGroup`: the same trajectory) at
`sweep.noise_reference_evals` log-spaced evaluations, each measuring the whole training set
(`reference_noise`), until `sweep.noise_window` evaluations past the lowest target's crossing.
Its record goes to `reference_noise.jsonl` (`cbs.analysis.fits.noise_at_target` reads it).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np

from cbs.engine.noise_spec import NoiseSpec
from cbs.results import files, shared
from cbs.results.store import SweepStore, target_key
from cbs.sweeps.grid import Trial
from cbs.sweeps.groups import TrialGroup

__all__ = ["ReferenceRun", "lowest_crossing", "protocol_text", "reference_noise",
           "reference_trial", "run_reference"]


def lowest_crossing(sweep: ml_collections.ConfigDict, records: Sequence[dict[str, Any]],
                    trial: Trial) -> float | None:
    """The step where `trial`'s record crossed the sweep's lowest target (None: not)."""
    key = target_key(min(sweep.targets))
    return next((r["steps_to_target"].get(key) for r in records
                 if r["index"] == trial.index and r["steps_to_target"].get(key) is not None),
                None)


def reference_trial(sweep: ml_collections.ConfigDict, records: Sequence[dict[str, Any]]
                    ) -> Trial | None:
    """The best trial at B_ref for the lowest target reached there (ties: fewer steps to the
    targets above), None when no trial at B_ref reached a target."""
    b_ref, seed = int(sweep.noise_reference_batch_size), int(sweep.seeds[0])
    rows = [r for r in records if r["batch_size"] == b_ref and int(r.get("seed", 0)) == seed]
    for target in sorted(sweep.targets):
        key = target_key(target)
        reached = [r for r in rows if r["steps_to_target"].get(key) is not None]
        if reached:
            best = min(reached, key=lambda r: (r["steps_to_target"][key], r["learning_rate"]))
            return Trial(index=best["index"], batch_size=b_ref,
                         learning_rate=best["learning_rate"], seed=seed)
    return None


def reference_noise(config: ml_collections.ConfigDict) -> NoiseSpec:
    """`config.noise` with `sweep.reference_noise`'s fields on the whole training set, tr(HΣ)
    (with curvature and m > 0) from m random deviations and the full-data Hessian."""
    s = NoiseSpec.of(config, "reference")
    return s.replace(examples="all", curvature=s.curvature and s.deviations > 0,
                     deviations=s.deviations if s.curvature else 0,
                     hessian_batch_size=0)  # the full-data Hessian


class ReferenceRun(TrialGroup):
    """A group of one trial measured by `reference_noise` (or `noise`) at each evaluation, no
    mid-run checkpoints, that stops `sweep.noise_window` evaluations past the lowest target."""

    def __init__(self, config: ml_collections.ConfigDict, trial: Trial, store: SweepStore, *,
                 crossing: float | None = None, noise: NoiseSpec | None = None):
        evals = int(config.sweep.noise_reference_evals)
        super().__init__(config, [trial], store, noise=noise or reference_noise(config),
                         evals=evals, checkpoint_every_evals=evals)
        self.workdir = os.path.join(store.sweep_dir, files.REFERENCE_DIR,
                                    f"b{trial.batch_size:06d}_s{trial.seed}")
        self.crossing = crossing  # the step where the sweep's trial crossed the lowest target

    def expected_steps(self) -> int | None:
        """The `noise_window`-th evaluation after the first at or past `crossing` (where the
        sweep's trial crossed the lowest target); None: the budget."""
        if self.crossing is None:
            return None
        j = bisect.bisect_left(self.steps, self.crossing)
        return int(self.steps[min(j + int(self.sweep.noise_window), len(self.steps) - 1)])

    def _finished(self, history) -> bool:
        m = self._metric_matrix(history)[self._skip:, 0]
        below = np.nonzero(m <= min(self.sweep.targets))[0]
        if below.size and m.size - below[0] > int(self.sweep.noise_window):
            return True
        return self.rule.scan(m).diverged


def protocol_text(config: ml_collections.ConfigDict, trial: Trial, num_train: int,
                  sampled: tuple[int, int, int] | None = None) -> str:
    """The record's description of the protocol; `sampled`: (n, m, h) of the sampled one."""
    s, window = config.sweep, int(config.sweep.noise_window)
    head = (f"one run at B={trial.batch_size} (its best rate {trial.learning_rate:.3g}, seed "
            f"{trial.seed}), {int(s.noise_reference_evals)} log-spaced evaluations, ")
    if sampled is not None:
        n, m, h = sampled
        return head + (f"the {window} from each target's crossing on measured by the sampled "
                       f"estimator (N={num_train}: n={n} examples of an independent stream for "
                       f"G and tr(Σ), tr(HΣ) from m={m} of their deviations and the Hessian of "
                       f"h={h} examples drawn independently); ratio of means over those "
                       "evaluations")
    m = reference_noise(config).deviations
    return head + (f"each exact on the full training set (N={num_train}; tr(HΣ) from "
                   f"{m} random deviations and the full-data Hessian); ratio "
                   f"of means over the first {window} evaluations at or after each target's "
                   "crossing")


def run_reference(config: ml_collections.ConfigDict, store: SweepStore, *,
                  log=print) -> dict[str, Any] | None:
    """Runs the reference trajectory once; its record (None: none at B_ref reached a target)."""
    path = os.path.join(store.sweep_dir, files.REFERENCE_NOISE_FILE)
    done = shared.read_merged(path, files.REFERENCE_RUN_KEYS)
    if done:
        return done[-1]
    trial = reference_trial(config.sweep, store.records())
    if trial is None:
        log(f"reference noise: no trial at B={config.sweep.noise_reference_batch_size} "
            "reached a target; no reference run")
        return None
    run = ReferenceRun(config, trial, store,
                       crossing=lowest_crossing(config.sweep, store.records(), trial))
    result = run.run()[0]
    record = {"batch_size": trial.batch_size, "learning_rate": trial.learning_rate,
              "seed": trial.seed, "target_metric": result.target_metric,
              "status": result.status, "seconds": result.seconds,
              "protocol": protocol_text(config, trial, run.dataset.num_train),
              "curve": result.curve}
    shared.add_records(path, files.REFERENCE_RUN_KEYS, [record])
    shared.export_parts(path, files.REFERENCE_RUN_KEYS)  # on an object store too
    log(f"reference noise: B={trial.batch_size}, lr={trial.learning_rate:.3g}, "
        f"{len(result.curve['step'])} evaluations, {result.seconds:.0f} s")
    return record
