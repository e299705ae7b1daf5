"""The study configs: the Kaplan §5 study end to end at its tiny size, the SGD sweep's shape."""

from cbs.analysis import report
from cbs.sweeps import grid, launch
from experiments.configs import digits_sgd_sweep, shakespeare_kaplan


def test_kaplan_study_config_brackets_and_extends():
    c = shakespeare_kaplan.get_config()
    s = c.sweep
    assert min(s.batch_sizes) <= 70 / 4 and max(s.batch_sizes) >= 4 * 300  # sequences
    assert len(s.seeds) >= 2 and s.extend_lr_rounds >= 1 and min(s.targets) < 2.2
    grid.validate_sweep(s)


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
    table = report.kaplan_table(analysis).splitlines()
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
