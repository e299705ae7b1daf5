"""Experiment configs: each file's `get_config(arg)` returns a `cbs.engine.config` ConfigDict."""
