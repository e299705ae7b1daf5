"""Batch-size sweeps: the trial grid (`grid`), running trials (`trials`, `groups`), the noise
measurement both trial runners record (`measurement`), the launcher (`launch`) and
batch-size ramps beside a sweep (`ramps`).
"""
