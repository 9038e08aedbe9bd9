"""slime-engine checkpoints on disk: keep the newest `checkpoint.keep` complete ones under `--save`.

Megatron writes each save as `iter_<7 digits>/` and names the last complete one in
`latest_checkpointed_iteration.txt`, and never deletes any (about 22 GB each for the 1.5B quickstart,
116 GB for LFM2.5-8B-A1B: weights, fp32 master copy, Adam moments). The after-train hook (publish.py)
calls `prune` on rank 0 before slime's next save, so the disk holds K complete checkpoints plus the one
being written. Only iterations at or below the tracker's are complete; a newer directory (a save cut
short) is left for Megatron to overwrite, and the tracker's own is never deleted.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"iter_(\d{7})")


def complete(save_dir: str | Path) -> list[int]:
    """Iterations of the complete checkpoints under `save_dir`, oldest first ([] without a tracker)."""
    root = Path(save_dir)
    try:
        latest = int((root / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return []
    found = [int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _ITER.fullmatch(p.name))]
    return sorted(i for i in found if i <= latest)


def prune(save_dir: str | Path | None, keep: int) -> list[int]:
    """Delete all but the newest `keep` complete checkpoints; returns the iterations deleted."""
    if keep < 1:
        raise ValueError(f"checkpoint.keep={keep} must be at least 1 (the newest is what a resume loads)")
    if not save_dir or not Path(save_dir).is_dir():
        return []
    doomed = complete(save_dir)[:-keep]
    for it in doomed:
        shutil.rmtree(Path(save_dir) / f"iter_{it:07d}", ignore_errors=True)
    return doomed
