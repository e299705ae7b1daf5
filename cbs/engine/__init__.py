"""The training engine: config (`config`), device mesh (`mesh`), optimizers (`optim`),
batch and learning-rate schedules (`schedules`), the jitted step (`step`, its packed metrics
`step_metrics`), the noise measurement of every path (`noise_spec`, `measure`), the host loop
(`loop`), run set-up (`trainer`), checkpoints (`checkpoint`) and the record writer (`writer`).
"""
