"""Where the theory does not hold: the digits sweep with plain SGD (no momentum).

    python -m experiments.sweep --config=experiments/configs/digits_sgd_sweep.py \
        --sweep_dir=results/digits_sgd

The model, data, batch sizes, targets and budget of `digits_sweep` (64-128-128-10 MLP, full
training-set loss), trained with plain SGD at a constant rate: a factor-2 grid centred on
the linear rule η(B) = 0.1·(B/64), capped at 2, extended past edge optima. Plain SGD is
a known case where the link between B_crit and the noise scale breaks: B_crit stops growing
at low loss while the measured B_simple keeps growing and overestimates B_crit several-fold.
The report shows what this sweep finds (results/digits_sgd/report.md). `:tiny` is the
shrunk grid of `digits_sweep:tiny` (tests).
"""

from __future__ import annotations

from experiments.configs import base, digits_sweep


def get_config(arg: str = ""):
    c = digits_sweep.get_config(arg)
    c.optim.name = "sgd"  # plain SGD: u = g, no momentum, constant learning rate
    s = c.sweep
    s.base_lr = 0.1  # η at B = 64, centre of the grid
    s.lr_rule = "linear"  # centre η(B) = base_lr·(B/64) (SGD)
    s.lr_factors = (0.5, 1.0, 2.0)  # factor-2 grid around the centre
    s.max_lr = 2.0  # SGD above this diverges on this model
    s.extend_lr_rounds = 5  # up to five factor-2 steps past an edge optimum
    if "tiny" in base.parse_arg(arg):
        s.lr_factors = (1.0, 2.0)  # two learning rates each
        s.extend_lr_rounds = 0  # no extension (tests)
    return c
