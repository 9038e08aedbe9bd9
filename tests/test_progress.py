"""trainer/progress.py: bars only where a person looks (a terminal, or forced), the same calls either way."""

from __future__ import annotations

import pytest

from trainer.progress import enabled, progress, stage, track


def test_forced_on_draws_to_stderr(monkeypatch, capsys):
    monkeypatch.setenv("DRL_PROGRESS", "1")
    with progress("uploading anchor", total=2048, unit="bytes") as advance:
        advance(1024)
        advance(1024)
    out = capsys.readouterr()
    assert "uploading anchor" in out.err and out.out == ""


def test_off_by_default_when_not_a_terminal(monkeypatch, capsys):
    monkeypatch.delenv("DRL_PROGRESS", raising=False)
    assert not enabled()  # pytest captures stderr: not a terminal
    assert list(track(range(3), "deleting")) == [0, 1, 2]
    monkeypatch.setenv("DRL_PROGRESS", "0")
    with progress("listing") as advance:
        advance()
    assert capsys.readouterr().err == ""


def test_unknown_unit_is_refused():
    with pytest.raises(ValueError, match="unit='parts'"):
        with progress("x", unit="parts"):
            pass


def test_a_stage_is_drawn_full_once_it_ends_and_not_after_an_error(monkeypatch, capsys):
    monkeypatch.setenv("DRL_PROGRESS", "1")
    with stage("saving torch_dist"):
        pass
    err = capsys.readouterr().err
    assert "saving torch_dist" in err and "1/1" in err
    with pytest.raises(RuntimeError, match="reload differs"), stage("verifying"):
        raise RuntimeError("reload differs")
    err = capsys.readouterr().err
    assert "verifying" in err and "1/1" not in err
    monkeypatch.setenv("DRL_PROGRESS", "0")
    with stage("loading"):
        pass
    assert capsys.readouterr().err == ""


def test_off_a_terminal_a_long_step_prints_lines_with_the_time_left(monkeypatch, capsys):
    """A build in a log or a pipe: a line at the start, one every `lines_every_s` with the count and the
    time left, one at the end; a bar on a terminal instead (rich's, with its time-remaining column)."""
    from trainer import progress as mod

    monkeypatch.delenv("DRL_PROGRESS", raising=False)
    now = [100.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])
    with progress("building the base model", total=1200, lines_every_s=30) as advance:
        for _ in range(300):
            now[0] += 0.5  # 0.5 s a step: a line every 60 steps
            advance(1)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "building the base model: starting"
    assert lines[1] == "building the base model: 60/1200 (5%), 30 s elapsed, about 9 min 30 s left"
    assert lines[-2] == "building the base model: 300/1200 (25%), 2 min 30 s elapsed, about 7 min 30 s left"
    assert lines[-1].startswith("building the base model: done, 300/1200 (25%)") and len(lines) == 7
    monkeypatch.setenv("DRL_PROGRESS", "1")
    with progress("building the base model", total=4, lines_every_s=30) as advance:
        advance(4)
    err = capsys.readouterr().err
    assert "4/4" in err and "starting" not in err
