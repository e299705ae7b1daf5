"""Batch-size sweeps: the trial grid (`grid`), running trials (`trials`, `groups`), the
launcher (`launch`) and batch-size ramps beside a sweep (`ramps`); both trial runners record
the one noise measurement of `cbs.engine.measure`.
"""
