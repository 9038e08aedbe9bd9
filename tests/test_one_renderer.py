"""A prompt is rendered in one place (worker_contract.tasks.base.render_prompt): the workers, the learner's
evaluations and the bases built on the spot build the same ids from the same messages."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_only_the_renderer_applies_the_chat_template():
    calls = [str(p.relative_to(ROOT)) for d in ("worker_contract", "trainer", "infra", "entrypoints", "bench")
             for p in (ROOT / d).rglob("*.py") if re.search(r"\.apply_chat_template\(", p.read_text())]
    assert calls == ["worker_contract/tasks/base.py"], calls
