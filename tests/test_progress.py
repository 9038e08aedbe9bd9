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
