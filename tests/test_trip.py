"""docs/architecture.md's rollout trip names exactly the files one native step runs through.

tests/trip_trace.py runs the step in a fresh process and lists every file whose functions ran, from the
source's poll to the moved pointer; the doc's list ("The trip's files (N)") must be that set, N its size.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


def doc_trip() -> tuple[int, set[str]]:
    """The count and the files the doc's "The trip's files (N)" paragraph names."""
    text = DOC.read_text()
    m = re.search(r"\*\*The trip's files \((\d+)\)\.\*\*(.*?)\n\n", text, re.S)
    assert m, f"{DOC.relative_to(ROOT)} has no paragraph starting **The trip's files (N).**"
    return int(m.group(1)), set(re.findall(r"`([\w/]+\.py)`", m.group(2)))


@pytest.mark.integration
def test_the_docs_trip_lists_the_files_a_step_runs_through(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "trip_trace.py"), str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ran = set(json.loads(out.stdout.strip().splitlines()[-1]))
    count, named = doc_trip()
    assert named == ran, (f"named in the doc, not run: {sorted(named - ran)}; "
                          f"run, not named in the doc: {sorted(ran - named)}")
    assert count == len(named)
