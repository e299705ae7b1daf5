"""Entry points (`python -m experiments.main`) and configs (`experiments/configs/`) for cbs."""
