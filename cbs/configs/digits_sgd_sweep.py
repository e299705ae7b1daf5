"""Where the theory does not hold: the digits sweep with plain SGD (no momentum).

    cbs-sweep --config=digits_sgd_sweep --sweep_dir=results/digits_sgd
    cbs-sweep --config=digits_sgd_sweep:seeds3 --sweep_dir=results/digits_sgd_seeds3
    cbs-analyze --sweep_dir=results/digits_sgd_seeds3 --select_on_seed=0

`digits_sweep` with plain SGD on the linear rule. Measured (results/digits_sgd/report.md):
B_crit stops growing at low loss (45 at L = 0.1, 50 at L = 0.05); the median B_simple over
batch sizes is 1.0-1.5 B_crit and the median B_noise 0.48-0.74 B_crit, but at L = 0.05
B_simple spans 31-620 and B_noise 5.8-345 across batch sizes: at the best rates the full
training loss oscillates between evaluations and |G|² and tr(HΣ) swing with it. About 30 min
on 2 shared CPU cores. `:tiny` and `:seeds3` as in `digits_sweep` (committed:
results/digits_sgd_seeds3, 159 trials, 27 min on 2 shared CPU cores).
"""

from __future__ import annotations

from cbs.configs import base, digits_sweep

__all__ = ["get_config"]


def get_config(arg: str = ""):
    c = digits_sweep.get_config(arg)
    c.optim.name = "sgd"  # plain SGD: u = g, no momentum, constant learning rate
    s = c.sweep
    s.base_lr = 0.1  # η at B = 64, centre of the grid
    s.lr_rule = "linear"  # centre η(B) = base_lr·(B/64) (SGD)
    s.lr_factors = (0.5, 1.0, 2.0)  # factor-2 grid around the centre
    s.max_lr = 2.0  # SGD above this diverges on this model
    s.extend_lr_rounds = 5  # up to five factor-2 steps past an edge optimum
    if "tiny" in base.parse_arg(arg, ("tiny", "seeds3")):
        s.lr_factors = (1.0, 2.0)  # two learning rates each
        s.extend_lr_rounds = 0  # no extension (tests)
    return c
