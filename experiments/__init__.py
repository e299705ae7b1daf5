"""Entry points (`python -m experiments.main`) and configs by repository path
(`experiments/configs/`, re-exporting the presets of `cbs.configs`) for cbs."""
