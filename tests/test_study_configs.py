"""The study configs: the Kaplan §5 study end to end at its tiny size, the SGD sweep's shape."""

import math
import os

import pytest

from cbs.analysis.reports import report, report_tables
from cbs.sweeps import grid, launch
from experiments.configs import digits_sgd_sweep, shakespeare_kaplan

RESULTS = os.path.join(os.path.dirname(__file__), "..", "results", "shakespeare_kaplan")


def test_kaplan_study_config_brackets_and_extends():
    c = shakespeare_kaplan.get_config()
    s = c.sweep
    committed = report.load_analysis(RESULTS)  # the run in README
    b_crits = [t["fit"]["b_crit"] for t in committed["targets"]]
    assert len(b_crits) == len(s.targets) and all(math.isfinite(b) for b in b_crits)
    assert min(s.batch_sizes) * 4 <= min(b_crits) and max(s.batch_sizes) >= 4 * max(b_crits)
    assert len(s.seeds) >= 2 and s.extend_lr_rounds >= 1 and min(s.targets) < 2.2
    grid.validate_sweep(s)


@pytest.mark.slow  # about 6 minutes on 2 cores (a Transformer per group compiles its steps)
def test_kaplan_tiny_runs_end_to_end_with_the_token_table(tmp_path):
    c = shakespeare_kaplan.get_config("tiny")
    d = str(tmp_path)
    results = launch.run_sweep(c, d, log=lambda _: None)
    assert len(results) >= len(grid.make_trials(c.sweep))
    text = open(report.write_report(d, bootstrap=20)).read()
    assert "In tokens, beside Kaplan et al. 2020" in text
    assert "32 tokens per sequence." in text
    analysis = report.load_analysis(d)
    assert analysis["tokens_per_example"] == 32 and analysis["complete"]
    table = report_tables.kaplan_table(analysis).splitlines()
    for t in analysis["targets"]:
        row = next(line for line in table if line.startswith(f"| {t['target']:g} |"))
        cells = [x.strip() for x in row.split("|")[1:-1]]
        if t["fit"]["status"] == "ok":  # tokens = sequences × 32 characters
            assert float(cells[2]) == float(f"{t['fit']['b_crit'] * 32:.3g}")
        else:
            assert cells[1:] == ["–", "–", "–"]


def test_sgd_sweep_is_plain_sgd_on_the_digits_grid():
    c = digits_sgd_sweep.get_config()
    assert c.optim.name == "sgd" and c.sweep.lr_rule == "linear"
    assert c.sweep.extend_lr_rounds >= 1
    launch.check_config(c)
