"""cbs.runtime.writer's progress bars (`tqdm.auto` in a notebook and on a terminal, lines in a
log) and `CountBar`, the bar of a study's finished trials; a sweep group's bar over its steps."""

from __future__ import annotations

import io
import os
import sys
import types

import pytest
import tqdm.auto

from cbs.runtime import writer
from cbs.runtime.writer import CountBar, LogLines, progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_counts_trials_with_rate_and_eta_and_keeps_the_lines(capsys):
    term = _Terminal()
    with CountBar(4, unit="trial", file=term) as bar:
        bar.log("B=4      lr=0.001  done ...")
        bar.update(3)
        bar.log("B=8      lr=0.002  done ...")
        bar.update(1)
    shown = term.getvalue()
    assert "4/4" in shown and "trial" in shown and "<" in shown  # elapsed<remaining (ETA)
    assert "trial/s" in shown or "s/trial" in shown  # the rate
    assert capsys.readouterr().out.splitlines() == ["B=4      lr=0.001  done ...",
                                                    "B=8      lr=0.002  done ..."]


def test_off_a_terminal_the_bar_is_a_line_now_and_then_and_none_when_disabled():
    log = io.StringIO()  # a Slurm or CI log: no carriage returns, whole lines
    lines: list[str] = []
    with CountBar(3, file=log, log=lines.append) as bar:  # 30 s between lines: only the last
        bar.log("line")
        bar.update(2)
        bar.update(1)
    assert log.getvalue().count("\n") == 1 and "\r" not in log.getvalue()
    assert "3/3" in log.getvalue() and "100%" in log.getvalue() and lines == ["line"]

    every = io.StringIO()
    with CountBar(3, file=every, interval=0) as bar:  # a line at each update, and at the end
        for _ in range(3):
            bar.update(1)
    shown = every.getvalue().splitlines()
    assert [s.split("| ")[1].split(" ")[0] for s in shown] == ["1/3", "2/3", "3/3", "3/3"]

    for stream in (io.StringIO(), _Terminal()):
        with CountBar(2, file=stream, enabled=False, log=lines.append) as bar:
            bar.log("quiet")
            bar.update(2)
        assert stream.getvalue() == ""
    assert lines == ["line", "quiet", "quiet"]


def test_log_lines_show_label_postfix_rate_and_resume_point():
    log = io.StringIO()
    bar = LogLines(10, unit="step", initial=4, desc="b000016_s0_t0-1", file=log, interval=0)
    bar.set_postfix({"loss": "1.25"})
    bar.update(2)
    bar.close()
    bar.close()  # once
    first, last = log.getvalue().splitlines()
    assert first.startswith("b000016_s0_t0-1:  60%") and "6/10" in first
    assert "loss=1.25" in first and "step" in first and "6/10" in last  # close: a last line


def test_the_bar_is_tqdm_auto_in_a_notebook_and_on_a_terminal(monkeypatch):
    """tqdm.auto draws a widget in a Jupyter kernel (stderr is not a terminal there) and a bar
    on a terminal; anywhere else the bar is `LogLines`."""
    assert not writer.in_notebook()
    plain = progress_bar(5, unit="step", file=io.StringIO())
    assert isinstance(plain, LogLines)
    term = progress_bar(5, unit="step", file=_Terminal())
    assert isinstance(term, tqdm.auto.tqdm)
    term.close()

    class _Shell:
        config = {"IPKernelApp": {"connection_file": "kernel.json"}}

    fake = types.ModuleType("IPython")
    fake.get_ipython = lambda: _Shell()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert writer.in_notebook()
    made = []
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda **kw: made.append(kw) or "widget")
    assert progress_bar(5, unit="step", file=io.StringIO(), desc="run") == "widget"
    assert made[0]["total"] == 5 and made[0]["desc"] == "run"

    def no_widgets(**kw):  # tqdm.notebook without ipywidgets
        raise ImportError("IProgress not found")

    monkeypatch.setattr(tqdm.auto, "tqdm", no_widgets)
    assert isinstance(progress_bar(5, unit="step", file=io.StringIO()), LogLines)


def _bar_steps(text: str, label: str) -> list[str]:
    return [s.split("| ")[1].split(" ")[0] for s in text.splitlines() if s.startswith(label)]


def test_a_groups_bar_follows_its_evaluations(tmp_path, capsys, monkeypatch):
    """A vmapped group writes only evaluation records (K per evaluation, one per trial): its
    bar advances to each evaluation's step; a run's advances past each train record's."""
    monkeypatch.setattr(writer, "LOG_INTERVAL_S", 0.0)
    w = writer.Outputs(label="b000016_s0_t0-1", nested=True).open(tmp_path, total_steps=20)
    for step in (0, 1, 3, 7, 20):
        w.write([{"step": step, "kind": "eval", "trial": t, "train/loss_ema": 1.0}
                 for t in (0, 1)])
    w.close()
    assert _bar_steps(capsys.readouterr().err, "b000016_s0_t0-1") == [
        "1/20", "3/20", "7/20", "20/20", "20/20"]
    run = writer.MetricsWriter(tmp_path / "run", total_steps=4, label="run")
    run.write([{"step": s, "kind": "train", "train/loss": 2.0} for s in range(2)])
    run.write([{"step": 2, "kind": "eval", "eval/loss": 1.5}])
    run.close()
    assert _bar_steps(capsys.readouterr().err, "run") == ["2/4", "2/4"]


def test_a_group_takes_its_bar_and_mirrors_from_the_sweep(tmp_path):
    from cbs.results import store
    from cbs.sweeps import grid
    from cbs.sweeps.groups import TrialGroup

    c = _tiny_sweep()
    c.train.progress_bar, c.train.tensorboard, c.train.wandb = True, True, "project"
    group = TrialGroup(c, grid.make_trials(c.sweep), store.SweepStore(str(tmp_path / "sw")))
    run = group.config.train
    assert (run.progress_bar, run.tensorboard, run.wandb) == (False, False, "")  # quiet
    assert group.outputs == writer.Outputs(
        progress=True, tensorboard=True, wandb="project", wandb_group="sw",
        label=os.path.basename(group.workdir), nested=True)


def test_a_trial_run_one_by_one_takes_the_sweeps_bar_and_mirrors(tmp_path, monkeypatch):
    """The other back end of sweeps (`sweep.vmap_trials=False`): each trial is a quiet run
    of the engine given the sweep's outputs."""
    from cbs.results import store
    from cbs.sweeps import grid, trials

    class _Given(Exception):
        pass

    def fake_run(config, workdir, **kwargs):
        raise _Given(config, kwargs["outputs"])

    monkeypatch.setattr(trials.trainer, "run", fake_run)
    c = _tiny_sweep()
    c.train.wandb = "project"
    trial = grid.make_trials(c.sweep)[0]
    with pytest.raises(_Given) as given:
        trials.run_trial_engine(c, trial, store.SweepStore(str(tmp_path / "sw")))
    run_config, outputs = given.value.args
    assert run_config.train.wandb == "" and not run_config.train.progress_bar
    assert outputs == writer.Outputs(progress=bool(c.train.progress_bar), wandb="project",
                                     wandb_group="sw", label=trial.trial_id, nested=True)


def _tiny_sweep():
    from experiments.configs import digits_sweep

    c = digits_sweep.get_config("tiny")
    c.sweep.batch_sizes, c.sweep.lr_factors = (16,), (1.0, 2.0)
    c.sweep.update(dict(targets=(0.01,), max_steps=20, evals_per_trial=4))
    return c


@pytest.mark.slow
def test_a_sweep_group_shows_its_steps_inside_the_sweeps_bar(tmp_path, capsys, monkeypatch):
    """A vmapped group of trials advances a bar over its steps, labelled with the group, at
    each evaluation (its run config is quiet: the sweep's `train.progress_bar` decides). Fast
    equivalents: the two tests above."""
    from cbs.results import store
    from cbs.sweeps import grid
    from cbs.sweeps.groups import TrialGroup

    monkeypatch.setattr(writer, "LOG_INTERVAL_S", 0.0)  # a line at each evaluation
    c = _tiny_sweep()
    c.train.progress_bar = True
    group = TrialGroup(c, grid.make_trials(c.sweep), store.SweepStore(str(tmp_path)))
    group.run()
    assert _bar_steps(capsys.readouterr().err, group.outputs.label) == [
        "1/20", "3/20", "7/20", "20/20", "20/20"]
