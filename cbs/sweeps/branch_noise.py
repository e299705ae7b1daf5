"""The noise scale of a branch study's reference run at its checkpoints
(`branch.noise_checkpoints`; in-memory data only).

Letters: N training examples, m of them (a fixed draw, `branch.noise_seed`) whose deviations
give tr(HΣ), H the Hessian of the mean loss over all N. The measurement (`measurement_spec`)
is the method "sampled" of `cbs.stats.sampled` on all N: G, tr(Σ), GᵀHG exact, tr(HΣ)
unbiased from the m deviations and the full-data Hessian, B_noise = tr(HΣ)/GᵀHG. Cost per
checkpoint: N per-example gradients and m + 1 HVPs over N examples. One record per checkpoint
in `reference_noise.jsonl`: step, examples_seen, num_examples, deviations, noise/<key>
(`cbs.stats.noise.STAT_KEYS`), estimator.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from cbs.engine import measure
from cbs.engine.noise_spec import NoiseSpec
from cbs.engine.state import count_to_int
from cbs.results import files, shared
from cbs.stats import noise

__all__ = ["NOISE_ESTIMATOR", "measure_reference_noise", "measurement_spec"]

NOISE_ESTIMATOR = ("exact on all N training examples: G, tr(Σ) from every per-example "
                   "gradient; tr(HΣ) from the deviations of m random examples weighed by the "
                   "full-data Hessian")
_FNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runner -> jitted measurement


def measurement_spec(config: ml_collections.ConfigDict) -> NoiseSpec:
    """`config.noise` with `branch.noise`'s fields (by default `NOISE_ESTIMATOR`)."""
    return NoiseSpec.of(config, "branch")


def _measure_at(runner: Any, step: int) -> dict[str, Any]:
    """The record of the reference after `step` updates (`NOISE_ESTIMATOR`)."""
    if not runner.parts.in_memory:
        raise ValueError("branch.noise_checkpoints needs an in-memory training set")
    tr, s = runner.parts, measurement_spec(runner.config)
    if runner not in _FNS:
        batch, hess = measure.all_examples(s, tr.dataset, tr.train_arrays,
                                           jax.random.key(int(runner.b.noise_seed)))

        def fn(params, model_state):
            loss = lambda p, bt: tr.loss_fn(p, model_state, bt)[0]
            stats = measure.measure(s, loss, params, batch, hessian_batch=hess,
                                    examples="all")
            return {k: getattr(stats, k) for k in noise.STAT_KEYS}

        _FNS[runner] = jax.jit(fn)
    state = runner.restore(step)
    out = jax.device_get(_FNS[runner](state.params, state.model_state))
    return {"step": step,
            "examples_seen": count_to_int(jax.device_get(state.examples_seen)),
            "num_examples": int(runner.parts.dataset.num_train),
            "deviations": min(s.deviations, int(runner.parts.dataset.num_train)),
            **{f"noise/{k}": float(v) for k, v in out.items()},
            "estimator": NOISE_ESTIMATOR}


def _noise_steps(config: ml_collections.ConfigDict, ckpt_steps: Sequence[int],
                points: Sequence[int]) -> list[int]:
    """Every branch point and the checkpoints nearest `noise_checkpoints` log-spaced steps."""
    n = int(config.branch.get("noise_checkpoints", 0))
    ckpts = sorted(s for s in ckpt_steps if s > 0)
    if not n or not ckpts:
        return []
    grid = np.geomspace(ckpts[0], ckpts[-1], n)
    chosen = {min(ckpts, key=lambda s: abs(math.log(s / g))) for g in grid}
    return sorted(chosen | set(points))


def measure_reference_noise(config: ml_collections.ConfigDict, workdir: str,
                             runner: Any, points: Sequence[int]) -> None:
    """Adds the measurements (`files.REFERENCE_NOISE_FILE`) the study does not have yet."""
    path = os.path.join(workdir, files.REFERENCE_NOISE_FILE)
    keys = files.REFERENCE_POINT_KEYS
    done = {r["step"] for r in shared.read_merged(path, keys)}
    for step in _noise_steps(config, runner.ckpt.all_steps(), points):
        if step not in done:
            shared.add_records(path, keys, [_measure_at(runner, step)])
    shared.export_parts(path, keys)  # on an object store, once for all checkpoints
