"""One noise protocol for a committed study: the reference trajectory, over seeds (the
protocol, its why and the measured studies: docs/guides/across_studies.md, "One noise
protocol").

`run_seeds` reruns the reference trajectory (`cbs.sweeps.reference.ReferenceRun`) at the
largest swept B ≤ B_crit/`fraction` (`choose_batch_size`) for seeds 0, 1, …, measured on the
whole training set (tr(HΣ) from ≥ `DEVIATIONS` random deviations and the full-data Hessian)
or, with `examples` = n > 0, by the sampled estimator of `cbs.stats.sampled` (m =
`deviations`, h = `hessian_examples`) in each target's window only. For Adam and AdamW it
also records the update u = P·g as `noise_p/<key>` (`cbs.stats.preconditioned`: B_simple^P =
tr(PΣ)/GᵀPG, B_noise^P = tr(PHPΣ)/GᵀPHPG, P the bias-corrected Adam preconditioner). One record
per seed in `reference_seeds/seed_<k>.jsonl` (runs in `reference_seeds/runs/`).
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from cbs.engine import config as config_lib
from cbs.engine import measure
from cbs.engine.noise_spec import FULL_DATA_MAX, NoiseSpec
from cbs.results import files, paths, records
from cbs.results.store import SweepStore, upgrade_noise_fields
from cbs.runtime.fields import ConfigError
from cbs.stats import preconditioned
from cbs.sweeps import reference
from cbs.sweeps.grid import Trial, default_sweep_config
from cbs.sweeps.groups import TrialGroup

__all__ = [
    "ADAPTIVE", "DEVIATIONS", "FRACTION", "HESSIAN_EXAMPLES", "SAMPLED_DEVIATIONS", "SEEDS_DIR",
    "choose_batch_size", "run_seeds", "seed_path", "study_config", "update_measurement",
]

SEEDS_DIR = "reference_seeds"  # in the sweep directory: seed_<k>.jsonl and runs/
DEVIATIONS = 256  # the fewest random deviations of tr(HΣ) the whole-training-set protocol takes
SAMPLED_DEVIATIONS = 64  # m of the sampled protocol (examples > 0): its default
HESSIAN_EXAMPLES = 256  # h of the sampled protocol: its default (the Hessian draw errs little)
FRACTION = 4  # B ≤ B_crit / FRACTION at the lowest target
PRECONDITIONED_KEYS = ("trace_sigma", "grad_sq_norm", "b_simple", "trace_h_sigma", "g_h_g",
                       "b_noise")  # recorded as noise_p/<key> (Adam, AdamW)
ADAPTIVE = ("adam", "adamw")  # optimizers whose update P·g is measured too (noise_p/)


def update_measurement(spec: NoiseSpec, loss_fn, params, precond, batch, hessian_batch, key,
                       examples: str | None = None) -> dict[str, jax.Array]:
    """The noise statistics of the update P·g (`PRECONDITIONED_KEYS`): `measure.measure` in
    the coordinates φ = θ/√P (`cbs.stats.preconditioned.rescaled`) on the plain draws."""
    phi = jax.tree.map(lambda q, s: q / jnp.sqrt(s), params, precond)
    stats = measure.measure(spec, preconditioned.rescaled(loss_fn, precond), phi, batch,
                            hessian_batch=hessian_batch, key=key, examples=examples)
    return {k: jnp.asarray(getattr(stats, k)) for k in PRECONDITIONED_KEYS
            if getattr(stats, k) is not None}


def seed_path(sweep_dir: str, seed: int) -> str:
    return os.path.join(sweep_dir, SEEDS_DIR, f"seed_{seed}.jsonl")


def study_config(sweep_dir: str) -> ml_collections.ConfigDict:
    """The committed study's config (sweep.json) in the current layout, over the defaults."""
    definition = SweepStore(sweep_dir).definition()
    if not definition:
        raise ConfigError(f"--sweep_dir: {sweep_dir} has no {files.SWEEP_FILE}; name a "
                          "committed study")
    raw = dict(definition.get("config") or {})
    raw.setdefault("sweep", definition.get("sweep", {}))
    raw = upgrade_noise_fields(raw)
    out = config_lib.default_config().to_dict()
    out["sweep"] = default_sweep_config().to_dict()

    def merge(into: dict[str, Any], values: dict[str, Any]) -> None:
        for k, v in values.items():
            if isinstance(v, dict) and isinstance(into.get(k), dict) and k != "model":
                merge(into[k], v)
            else:
                into[k] = tuple(v) if isinstance(v, list) else v

    merge(out, raw)
    return ml_collections.ConfigDict(out)


def choose_batch_size(sweep: ml_collections.ConfigDict, b_crit: float,
                      fraction: float = FRACTION) -> int:
    """The largest of the sweep's batch sizes with B ≤ b_crit / fraction."""
    fit = [int(b) for b in sweep.batch_sizes if b <= b_crit / fraction]
    if not fit:
        raise ValueError(f"no batch size of the sweep {list(sweep.batch_sizes)} is <= "
                         f"B_crit/{fraction:g} = {b_crit / fraction:.3g}")
    return max(fit)


def sampled_noise(config: ml_collections.ConfigDict, examples: int, deviations: int,
                  hessian_examples: int) -> NoiseSpec:
    """The sampled protocol's measurement (n, m, h: module docstring)."""
    noise = NoiseSpec.of(config)
    chunk = noise.chunk_size or SAMPLED_CHUNK
    return noise.replace(
        method="sampled", examples="stream", batch_size=int(examples), curvature=True,
        deviations=int(deviations), hessian_batch_size=int(hessian_examples),
        chunk_size=min(chunk, int(examples)), every=0, in_step=False)


SAMPLED_CHUNK = 1024  # examples per vmap chunk of the sampled protocol (memory)


class SeedReferenceRun(reference.ReferenceRun):
    """`reference.ReferenceRun` measured from the first crossing of the highest target on (with
    `windows`: only in each target's window), for Adam/AdamW also `noise_p/<key>`."""

    def __init__(self, config: ml_collections.ConfigDict, trial: Trial, store: SweepStore, *,
                 crossing: float | None = None, noise: NoiseSpec | None = None,
                 windows: bool = False):
        super().__init__(config, trial, store, crossing=crossing, noise=noise)
        self.windows = windows
        # per target, measurements of its window still due (None: not yet crossed)
        self._left: dict[float, int | None] = {float(t): None for t in self.sweep.targets}
        self.workdir = os.path.join(store.sweep_dir, SEEDS_DIR, "runs",
                                    f"b{trial.batch_size:06d}_s{trial.seed}")
        self.preconditioner = str(config.optim.name) in ADAPTIVE
        if self.preconditioner:
            self.curve_keys += [f"noise_p/{k}" for k in PRECONDITIONED_KEYS]
        self._measure_below = max(float(t) for t in self.sweep.targets)
        self._measuring = False
        self._progress_jit = jax.jit(jax.vmap(self._progress_fn, in_axes=(0, 0, None)))
        self._noise_jit = jax.jit(jax.vmap(self._noise_fn, in_axes=(0, None)))
        self._empty: dict[str, np.ndarray] | None = None

    def _progress_fn(self, state, loss_ema, index):
        out = TrialGroup._evaluate_fn(self, state, loss_ema, index)
        return {k: v for k, v in out.items()
                if not k.startswith("noise/") or k == "noise/ema_b_simple"}

    def _noise_fn(self, state, index):
        out = {f"noise/{k}": v for k, v in self._measure(state, index).items()}
        if not self.preconditioner:
            return out
        optim = self.parts.config.optim
        p = preconditioned.adam_preconditioner(state.opt_state, eps=float(optim.eps),
                                               b2=float(optim.b2))
        examples, grad_batch, hess_batch, key = measure.draw(
            self.noise, self.dataset, self.parts.train_arrays, index, seed=self.trial_seed)
        loss = lambda q, b: self.parts.loss_fn(q, state.model_state, b)[0]
        # the sampled protocol measures B_simple^P only (its HVPs would double the cost)
        spec = self.noise.replace(curvature=False) if self.windows else self.noise
        stats = update_measurement(spec, loss, state.params, p, grad_batch,
                                   hess_batch if spec.curvature else None, key, examples)
        return out | {f"noise_p/{k}": v.astype(jnp.float32) for k, v in stats.items()}

    def _evaluate(self, states, loss_ema, index):
        i = jnp.asarray(index, jnp.int32)
        out = self._progress_jit(states, loss_ema, i)
        value = float(np.asarray(out[self.sweep.target_metric])[0])
        if self.windows:
            self._measuring = self._window_due(value)
        else:
            self._measuring = self._measuring or value <= self._measure_below
        if self._measuring:
            return out | self._noise_jit(states, i)
        if self._empty is None:
            shapes = jax.eval_shape(self._noise_jit, states, i)
            self._empty = {k: np.full(s.shape, np.nan, np.float32) for k, s in shapes.items()}
        return out | self._empty

    def _window_due(self, value: float) -> bool:
        """Whether this evaluation lies in some target's window (from its first crossing)."""
        for t, left in self._left.items():
            if left is None and math.isfinite(value) and value <= t:
                self._left[t] = int(self.sweep.noise_window)
        due = any(left for left in self._left.values())
        self._left = {t: (left - 1 if left else left) for t, left in self._left.items()}
        return due


def run_seeds(sweep_dir: str, *, seeds: int = 3, deviations: int | None = None,
              fraction: float = FRACTION, evals: int | None = None, batch_size: int = 0,
              examples: int = 0, hessian_examples: int = HESSIAN_EXAMPLES,
              log=print) -> list[dict[str, Any]]:
    """Runs the protocol for seeds 0 … seeds − 1 of the study in `sweep_dir` (skipping those
    written); returns every seed's record. `evals` default `sweep.noise_reference_evals`;
    `batch_size` default `choose_batch_size`; `examples` n (0: the whole set), `deviations`
    m (default `SAMPLED_DEVIATIONS`, else `DEVIATIONS`), `hessian_examples` h."""
    sampled = examples > 0
    if deviations is None:
        deviations = SAMPLED_DEVIATIONS if sampled else DEVIATIONS
    if not sampled and deviations < DEVIATIONS:
        raise ConfigError(f"--deviations: the protocol takes >= {DEVIATIONS} deviations, "
                          f"got {deviations}")
    if sampled and not 2 <= deviations <= examples:
        raise ConfigError(f"--deviations: the sampled protocol takes 2 <= m <= --examples "
                          f"({examples}), got {deviations}")
    if sampled and hessian_examples < 1:
        raise ConfigError(f"--hessian_examples: must be >= 1, got {hessian_examples}")
    if seeds < 1:
        raise ConfigError(f"--seeds: must be >= 1, got {seeds}")
    config, store = study_config(sweep_dir), SweepStore(sweep_dir)
    path = os.path.join(sweep_dir, files.ANALYSIS_FILE)  # the lowest target's fitted B_crit
    analysis = records.read_json(path)
    if analysis is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    fitted = [(t["target"], t["fit"].get("b_crit")) for t in analysis["targets"]
              if t["fit"].get("b_crit") is not None and math.isfinite(t["fit"]["b_crit"])]
    if not fitted:
        raise ValueError(f"{path}: no target has a B_crit fit")
    target, b_crit = min(fitted)
    b = int(batch_size) or choose_batch_size(config.sweep, b_crit, fraction)
    with config.unlocked():
        config.sweep.noise_reference_batch_size = b
        config.sweep.reference_noise.deviations = int(deviations)
        if evals:
            config.sweep.noise_reference_evals = int(evals)
    best = reference.reference_trial(config.sweep, store.records())
    if best is None:
        raise ValueError(f"no trial of {sweep_dir} at B={b} reached a target")
    crossing = reference.lowest_crossing(config.sweep, store.records(), best)  # seed 0's
    out = []
    for seed in range(seeds):
        path = seed_path(sweep_dir, seed)
        done = records.read_records(path)
        if done:
            out.append(done[-1])
            continue
        trial = dataclasses.replace(best, seed=seed)
        noise = sampled_noise(config, examples, deviations, hessian_examples) if sampled else None
        run = SeedReferenceRun(config, trial, store, crossing=crossing, noise=noise,
                               windows=sampled)
        if not sampled and run.dataset.num_train > FULL_DATA_MAX:
            log(f"{sweep_dir}: every evaluation passes over all N = "
                f"{run.dataset.num_train:,} training examples ({DEVIATIONS}+ HVPs over N "
                "each); --examples=4096 measures the sampled protocol at each target's "
                "window instead")
        result = run.run()[0]
        record = {
            "batch_size": b, "learning_rate": trial.learning_rate, "seed": seed,
            "lowest_target": target, "b_crit_lowest_target": b_crit, "fraction": fraction,
            "deviations": int(deviations), "evals": len(run.steps) - 1,
            "optimizer": str(config.optim.name),
            "preconditioner": "adam" if run.preconditioner else None,
            "target_metric": result.target_metric, "status": result.status,
            "seconds": result.seconds,
            "protocol": reference.protocol_text(
                config, trial, run.dataset.num_train,
                (examples, deviations, hessian_examples) if sampled else None),
            "curve": result.curve}
        if sampled:
            record |= {"method": "sampled", "examples": int(examples),
                       "hessian_examples": int(hessian_examples)}
        paths.makedirs(os.path.dirname(path))
        records.append_records(path, [record])
        log(f"{sweep_dir}: seed {seed}, B={b} (B_crit/{b_crit / b:.3g} at L={target:g}), "
            f"lr={trial.learning_rate:.3g}, {len(result.curve['step'])} evaluations, "
            f"{result.seconds:.0f} s, {result.status}")
        out.append(record)
    return out

