"""What slime's rollout process hands its train processes, and its own next start: one file, one model.

The rollout function writes it after each batch (`record`); the audit and after-train hooks read the note
of their rollout id (`note_for`); a restarted rollout process takes its reuse ledger back from it. It is
written whole and atomically (a temporary file, then a rename), and a reader refuses another version.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from trainer.step import BatchNote

HANDOFF_FILE = "handoff.json"
HANDOFF_VERSION = 1
#: batches kept (slime's async driver prepares one rollout ahead of the one being trained)
KEEP_BATCHES = 4


class HandoffError(ValueError):
    """The hand-off file is of another version, or does not parse."""


class Handoff(BaseModel):
    model_config = ConfigDict(extra="forbid")
    handoff_version: int = HANDOFF_VERSION
    """This file's own format; a reader of another refuses it (not a policy version)."""
    ledger: dict = {}
    """The rollout source's reuse ledger (RolloutSource.ledger_state) after the newest batch."""
    batches: dict[int, BatchNote] = {}
    """The newest KEEP_BATCHES batches' notes, by rollout id."""

    def record(self, rollout_id: int, note: BatchNote, ledger: dict) -> None:
        self.ledger = ledger
        self.batches[int(rollout_id)] = note
        for old in sorted(self.batches)[:-KEEP_BATCHES]:
            del self.batches[old]

    def note_for(self, rollout_id: int) -> BatchNote | None:
        return self.batches.get(int(rollout_id))


def read(state_dir: Path) -> Handoff:
    """The hand-off in `state_dir` (an empty one before the first batch)."""
    path = Path(state_dir) / HANDOFF_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Handoff()
    try:
        raw = json.loads(text)
        version = raw.get("handoff_version") if isinstance(raw, dict) else None
        if version == HANDOFF_VERSION:
            return Handoff.model_validate(raw)
    except (ValueError, ValidationError) as e:
        why = e.errors()[0]["msg"] if isinstance(e, ValidationError) else "not JSON"
        raise HandoffError(f"{path} does not read as a hand-off ({why}): remove it, or relaunch with "
                           "the slime plugin that wrote it") from None
    raise HandoffError(f"{path} is hand-off version {version}, this plugin reads {HANDOFF_VERSION}: finish "
                       "the run with the plugin that wrote it, or remove the file")


def write(state_dir: Path, handoff: Handoff) -> None:
    """Write it whole: a reader in another process sees the old file or the new one, never a part."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / (HANDOFF_FILE + ".tmp")
    tmp.write_text(handoff.model_dump_json())
    tmp.replace(state_dir / HANDOFF_FILE)
