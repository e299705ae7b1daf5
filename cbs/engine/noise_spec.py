"""What a run estimates and measures of its gradient noise, and when: `NoiseSpec`, the one
reading of `config.noise` (`NoiseSpec.from_config`, which validates every field and raises
`cbs.runtime.fields.ConfigError` naming it; nothing else reads that section). A study's own
measurement (a sweep's reference run, a branch study's checkpoints) is the same spec with the
fields its section sets (`STUDY_SECTIONS`) in place of the run's (`NoiseSpec.of(config,
study)`). The live estimate every step is `cbs.engine.live_noise`'s.

Letters: n examples measured (𝓑), m of them whose deviations give tr(HΣ) (𝓐), h examples of
an independent Hessian draw (𝓒), N training examples, k steps between measurements.

Which examples (`examples`):

- "step": the first n of the train step's own batch, every k steps only (with curvature, the
  deviations from one half and H from the other);
- "stream": at each evaluation, n examples of a training stream independent of training's and
  h independent examples for H (n = 0: off);
- "all": at each evaluation, the whole training set; "auto": "all" when N ≤ `FULL_DATA_MAX`,
  else "stream".

`every` > 0 measures the step's own examples every k steps whatever `examples` says. The
method "auto" stands for the exact estimator on the step's examples, "sampled" on a stream's
and "full_data" on all N (`resolved_method`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from cbs.engine import live_noise
from cbs.results.store import MOVED_NOISE_FIELDS
from cbs.runtime import fields
from cbs.stats import noise

__all__ = ["AUTO_METHOD", "EXAMPLES", "FULL_DATA_MAX", "FULL_DATA_METHOD", "NoiseSpec"]

EXAMPLES = ("step", "stream", "all", "auto")  # values of noise.examples
FULL_DATA_MAX = 10_000  # examples "auto": the whole training set when N <= this many
# The method "auto" stands for, by the examples measured.
AUTO_METHOD = {"step": "auto", "stream": "sampled", "all": "full_data"}
FULL_DATA_METHOD = "full_data"  # the whole-training-set estimator (cbs.stats.sampled)
# The sections of a study's own measurement (`NoiseSpec.of(config, study)`): fields of
# config.noise that replace the run's for that measurement (m of a reference run, say).
STUDY_SECTIONS = {"reference": "sweep.reference_noise", "branch": "branch.noise"}


@dataclasses.dataclass(frozen=True)
class NoiseSpec:
    """One run's (or one sweep's) noise measurement; see the module docstring."""

    method: str = "auto"  # a registered method, or "auto" (`resolved_method`)
    examples: str = "step"  # "step" | "stream" | "all" | "auto" (module docstring)
    batch_size: int = 0  # n; "step": a multiple of R·m, 0 = one micro-batch; "stream": 0 = off
    deviations: int = 0  # m, examples whose deviations give tr(HΣ); 0 = all measured
    hessian_batch_size: int = 0  # h, examples of the independent Hessian draw 𝓒 ("stream";
    #                              "all": 0 = all N)
    curvature: bool = False  # also tr(HΣ), GᵀHG and b_noise
    num_probes: int = 1  # probe vectors ("probe")
    chunk_size: int = 0  # examples per vmap chunk of an exact pass; 0 = all at once
    every: int = 0  # k, steps between measurements of the step's examples; 0 = never
    in_step: bool = False  # every k steps: in the step's own jit (a variant compiled for the
    #                        measured steps) or in a jit call of its own before the step
    live: str = "auto"  # the live estimate every step: "auto" | "exact" | "two_batch" | "none"
    small_batch: int = 0  # b of the two-batch live estimate; 0 = automatic
    ema_decay: float = 0.95  # decay of the live estimates' NoiseScaleEMA (per step)
    advice_calibration: str = ""  # calibration file of the live advice; "" = the shipped one

    def __post_init__(self):
        self.check()

    @classmethod
    def from_config(cls, noise_config: Any, at: str = "config.noise") -> NoiseSpec:
        """The spec of `config.noise` (missing optional fields: the defaults above; errors
        name the section `at`; sizes against the batch: `cbs.engine.config.validate`)."""
        get = noise_config.get
        fields.integer(noise_config, "every", at, minimum=0)
        fields.choice(noise_config, "method", at, noise.method_names())
        fields.integer(noise_config, "batch_size", at, minimum=0)
        fields.integer(noise_config, "num_probes", at)
        fields.integer(noise_config, "chunk_size", at, minimum=0)
        fields.integer(noise_config, "small_batch", at, minimum=0)
        for name in ("deviations", "hessian_batch_size"):
            if name in noise_config:
                fields.integer(noise_config, name, at, minimum=0)
        for name, choices in (("examples", EXAMPLES), ("live", live_noise.LIVE_METHODS)):
            if name in noise_config:
                fields.choice(noise_config, name, at, choices)
        for name in ("curvature", "in_step", "two_batch"):
            if not isinstance(get(name, name == "two_batch"), bool):
                raise fields.ConfigError(f"{at}.{name}: must be True or False, got "
                                         f"{get(name)!r}")
        decay = fields.number(noise_config, "ema_decay", at)
        if not decay < 1:
            raise fields.ConfigError(f"{at}.ema_decay: must be < 1, got {decay}")
        calibration = get("advice_calibration", "")
        if not isinstance(calibration, str):
            raise fields.ConfigError(f"{at}.advice_calibration: a path to a calibration file "
                                     f"or \"\", got {calibration!r}")
        return cls(method=str(noise_config.method), examples=str(get("examples", "step")),
                   batch_size=int(noise_config.batch_size), deviations=int(get("deviations", 0)),
                   hessian_batch_size=int(get("hessian_batch_size", 0)),
                   curvature=bool(get("curvature", False)), num_probes=int(noise_config.num_probes),
                   chunk_size=int(noise_config.chunk_size), every=int(noise_config.every),
                   in_step=bool(get("in_step", False)), small_batch=int(noise_config.small_batch),
                   live=str(get("live", "auto")) if get("two_batch", True) else "none",
                   ema_decay=float(decay), advice_calibration=calibration)

    @classmethod
    def of(cls, config: Any, study: str = "") -> NoiseSpec:
        """The spec of a run config's `noise` section; with `study`, of a study's own
        measurement: the fields its section sets (not None) replace those of `noise`."""
        spec = cls.from_config(config.noise)
        if not study:
            return spec
        section: Any = config
        for name in STUDY_SECTIONS[study].split("."):
            section = section.get(name) if section is not None else None
        given = {k: v for k, v in dict(section or {}).items() if v is not None}
        at = f"config.{STUDY_SECTIONS[study]}"
        for name in given:
            if name not in CONFIG_FIELDS:
                raise fields.ConfigError(f"{at}.{name}: not a field of config.noise (one of "
                                         f"{sorted(CONFIG_FIELDS)})")
        merged = ml_collections.ConfigDict(config.noise.to_dict())
        merged.update(given)
        try:
            return cls.from_config(merged, at)
        except fields.ConfigError as err:  # `check` names config.noise
            raise fields.ConfigError(str(err).replace("config.noise.", f"{at}.", 1)) from None

    def check(self) -> None:
        """The checks within the spec; ConfigError naming the `config.noise` field."""
        def fail(name: str, problem: str):
            raise fields.ConfigError(f"config.noise.{name}: {problem}")

        if self.examples not in EXAMPLES:
            fail("examples", f"must be one of {EXAMPLES}, got {self.examples!r}")
        if self.method != "auto" and self.method not in noise.method_names():
            fail("method", f"unknown method {self.method!r}; known: {noise.method_names()}")
        if self.method == FULL_DATA_METHOD and self.examples not in ("all", "auto"):
            fail("method", f"'{FULL_DATA_METHOD}' measures the whole training set: set "
                           "noise.examples='all'")
        if self.curvature and self.deviations == 1:
            fail("deviations", "needs >= 2 examples (or 0 = all measured)")
        if self.live not in live_noise.LIVE_METHODS:
            fail("live", f"must be one of {live_noise.LIVE_METHODS}, got {self.live!r}")
        if self.curvature and self.examples == "stream" and self.hessian_batch_size < 1:
            fail("hessian_batch_size", "must be >= 1 for a curvature measurement on a stream")

    @property
    def measures_at_evals(self) -> bool:
        """Whether each evaluation measures (not "step"; "stream" with n > 0)."""
        return self.examples != "step" and (self.examples != "stream" or self.batch_size > 0)

    def examples_for(self, num_train: int) -> str:
        """The examples measured with N = `num_train` training examples ("auto" resolved)."""
        if self.examples == "auto":
            return "all" if num_train <= FULL_DATA_MAX else "stream"
        return self.examples

    def resolved_method(self, examples: str | None = None) -> str:
        """The registered method that measures `examples` (default: the spec's)."""
        if self.method != "auto":
            return self.method
        return AUTO_METHOD[examples or self.examples]

    def replace(self, **changes) -> NoiseSpec:
        return dataclasses.replace(self, **changes)


# Fields of config.noise (`NoiseSpec.from_config`; "two_batch" reads as live="none").
CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(NoiseSpec)) | {"two_batch"}


def check_moved_keys(section: Any, name: str) -> None:
    """ConfigError naming the new field of a measurement setting still in the config's
    section `name` ("sweep", "branch"; `cbs.results.store.MOVED_NOISE_FIELDS`)."""
    for old, new in MOVED_NOISE_FIELDS.items():
        where, _, key = old.partition(".")
        if where == name and key in section:
            hint = " (with curvature=True)" if new == "noise.deviations" else ""
            raise fields.ConfigError(f"config.{old}: moved to config.{new}{hint}")
