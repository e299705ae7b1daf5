"""Helpers shared by the config files (this file is not a config itself).

Every config starts from `cbs.engine.config.default_config()`, whose fields all carry a comment with
their meaning and units; a config file sets only what differs and comments each change.
"""

from __future__ import annotations

import ml_collections

from cbs import models
from cbs.engine import config as config_lib


def base_config(dataset: str, model: str) -> ml_collections.ConfigDict:
    """default_config() with `data.name` and the model's default sub-config set."""
    c = config_lib.default_config()
    c.data.name = dataset  # registry name in cbs.data
    c.model = models.default_model_config(model)  # architecture defaults (cbs.models)
    return c


def parse_arg(arg: str) -> set[str]:
    """Comma-separated words of the config argument ("tiny", ...)."""
    return {w.strip() for w in (arg or "").split(",") if w.strip()}


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


def schedule_config(fields: dict) -> ml_collections.ConfigDict:
    """A `config.batch.schedule` from a plain dict (see batch_schedule_from_config)."""
    return ml_collections.ConfigDict(dict(fields))
