"""The docs' commands work as written: a join card written to be sourced is written in the env format, a card
a worker keeps is outside its checkout (and ignored by git if it lands there anyway), and a card whose model
is a directory on the trainer's machine says to copy it (a Mac could not fetch it)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from test_manifest import make_manifest

from worker_contract.joincard import build_card, render
from worker_contract.manifest import ContractMismatch, create_or_resume

REPO = Path(__file__).resolve().parent.parent
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", *sorted((REPO / "runs").rglob("*.md"))]


def test_a_card_written_out_is_the_sourceable_one():
    """docs/quickstart-gpu.md's `invoke joincard --reveal --out card.env` wrote the text card: sourcing it fails."""
    bad = []
    for doc in DOCS:
        text = re.sub(r"\s+", " ", doc.read_text())
        for cmd in re.findall(r"invoke joincard[^`#]*", text):
            if "--out" in cmd and "--format env" not in cmd:
                bad.append(f"{doc.relative_to(REPO)}: {cmd.strip()}")
    assert bad == []


def test_a_sourced_card_lives_outside_the_checkout():
    """docs/mac-worker.md wrote the card into the checkout (`pbpaste > card.env`), where git did not ignore it."""
    sourced = [(doc.relative_to(REPO), m) for doc in DOCS for m in re.findall(r"(?:\. |source )(\S*card\.env)",
                                                                             doc.read_text())]
    assert sourced and all(path.startswith("~/.stoa/cards/") for _, path in sourced), sourced
    written = [(doc.relative_to(REPO), m) for doc in DOCS for m in re.findall(r"> (\S*card\.env)", doc.read_text())]
    assert all(path.startswith("~/.stoa/cards/") for _, path in written), written
    ignored = subprocess.run(["git", "check-ignore", "-q", "card.env"], cwd=REPO)
    assert ignored.returncode == 0, "card.env in a checkout is not ignored by git"


def test_a_run_whose_model_is_a_local_directory_says_to_copy_it(file_store):
    """An embedded run's run.json names its base by the trainer's path: a Mac's worker tried the hub with it."""
    from worker_contract.worker.loop import WorkerSettings, resolve_model_dir

    m = make_manifest("local-base", model_id="/root/dRL/.stoa/base/gsm8k-0123abcd")
    create_or_resume(file_store, m, resume=False)
    card = build_card(file_store, "local-base", {})
    for fmt in ("text", "env"):
        assert "copy its config.json, tokenizer files and chat_template.jinja" in render(card, fmt)
    assert "copy" not in render(build_card(file_store, "local-base", {}), "json")
    with pytest.raises(ContractMismatch, match="directory on the trainer's machine.*--model DIR"):
        resolve_model_dir(WorkerSettings(store=file_store.url, run="local-base"), m)
