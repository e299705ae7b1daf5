"""Helpers shared by the config files. Every config starts from
`cbs.engine.config.default_config()` (each field's meaning and units commented there) and sets,
with a comment, what differs."""

from __future__ import annotations

import os

import ml_collections
from ml_collections import config_dict

from cbs import data, models
from cbs.engine import config as config_lib

__all__ = ["base_config", "make_tiny", "make_tiny_sweep", "parse_arg", "repo_root", "seeded"]


def base_config(dataset: str, model: str) -> ml_collections.ConfigDict:
    """default_config() with `data.name` and the model's default sub-config set."""
    c = config_lib.default_config()
    c.data.name = dataset  # registry name in cbs.data
    if "download" in data.dataset_options(dataset):  # TFDS: settable on the command line
        c.data.options.download = False  # fetch and prepare it if missing (needs network)
        c.data.options.data_dir = config_dict.placeholder(str)  # None: $TFDS_DATA_DIR or ~
    c.model = models.default_model_config(model)  # architecture defaults (cbs.models)
    return c


def parse_arg(arg: str, known: tuple[str, ...] = ("tiny",)) -> set[str]:
    """The comma-separated words of `arg`, each one of `known` (else ValueError)."""
    words = {w.strip() for w in (arg or "").split(",") if w.strip()}
    unknown = sorted(words - set(known))
    if unknown:
        raise ValueError(f"unknown config argument {', '.join(map(repr, unknown))} in "
                         f"{arg!r}; known: {', '.join(known)} (comma-separated)")
    return words


def repo_root() -> str:
    """The repository's root (where `results/` holds the committed studies)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def seeded(runs: list[dict], seeds: tuple[int, ...]) -> list[dict]:
    """Each ramp spec repeated over `seeds`: label "NAME · seed S", with `name` and `seed`."""
    return [run | {"label": f"{run['label']} · seed {s}", "name": run["label"], "seed": int(s)}
            for run in runs for s in seeds]


def make_tiny(c: ml_collections.ConfigDict, *, steps: int = 20) -> ml_collections.ConfigDict:
    """Shrinks a config to seconds on one CPU core (tests, smoke runs)."""
    c.train.max_steps = steps  # a handful of updates
    c.train.log_every = 5  # read metrics every 5 steps
    c.train.checkpoint_every = 10  # exercise save and resume
    c.train.progress_bar = False  # quiet in tests
    c.eval.every = 10  # evaluate twice
    c.eval.num_examples = 256  # first 256 evaluation examples
    c.eval.train_examples = 512  # first 512 training examples for full_train/*
    c.noise.every = 10  # one exact measurement in the middle
    return c


def make_tiny_sweep(s: ml_collections.ConfigDict, *, steps: int, evals: int) -> None:
    """Shrinks a sweep's trials to `steps` updates and `evals` evaluations (tests)."""
    s.max_steps = steps  # a few dispatches per trial
    s.max_examples = 0  # steps bound the budget
    s.evals_per_trial = evals  # evaluations per trial
    s.extend_lr_rounds = 0  # no extension rounds (tests turn them on)
