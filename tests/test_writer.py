"""cbs.engine.writer.CountBar: the progress bar of a study's finished trials (done/total,
rate, ETA on stderr) beside the lines a sweep prints for each finished group."""

from __future__ import annotations

import io

from cbs.engine.writer import CountBar


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


def test_no_bar_off_a_terminal_or_when_disabled():
    lines: list[str] = []
    for term, enabled in [(io.StringIO(), True), (_Terminal(), False)]:
        with CountBar(2, file=term, enabled=enabled, log=lines.append) as bar:
            bar.log("line")
            bar.update(2)
        assert term.getvalue() == ""
    assert lines == ["line", "line"]
