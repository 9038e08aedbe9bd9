"""Learner checkpoints: model, optimizer, RNG states, step, consumption ledger, last published version.

Layout under `<run_dir>/checkpoints/`: `step-0000000012/` holds the backend's files, `rng.pt` and
`state.json` (written last). A checkpoint is written into a temporary directory, fsynced, then renamed
into place, so a crash at any instant leaves either the old set or the old set plus a complete new one;
a leftover temporary directory is removed on the next start. The newest `keep` checkpoints are kept
(default: newest + one previous).
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from worker_contract.store.file import fsync_dir


class Checkpointable(Protocol):
    """What a checkpoint asks of the learner's backend (trainer/backends/base.py has each): its state in and
    out of a checkpoint folder, and, for a backend whose state is in this process, the files a background save
    copies while the next steps wait at the gate."""

    def save_checkpoint(self, path: Path) -> None: ...
    def load_checkpoint(self, path: Path) -> None: ...
    def checkpoint_files(self) -> dict[str, Any] | None: ...
    def attach_checkpoint_gate(self, gate: Any) -> bool: ...

FORMAT = 1
_NAME_RE = re.compile(r"^step-(\d{10})$")
_TMP_PREFIX = ".tmp-"


class CheckpointError(ValueError):
    """No checkpoint of the run can be loaded, though it has some."""


@dataclass
class TrainerState:
    step: int
    """Optimizer steps taken."""
    ledger: dict
    """The rollout source's consumption ledger (RolloutSource.ledger_state())."""
    last_published_version: int | None
    """The newest version the publisher had made visible when the checkpoint was taken."""
    extra: dict = field(default_factory=dict)
    """Anything else the learner wants back (JSON-ready)."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:010d}"


def _fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def capture_rng() -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(root: str | Path, state: TrainerState, backend: Checkpointable, *, keep: int = 2) -> Path:
    """Write a checkpoint for `state.step` atomically; prune to the newest `keep`. Returns its path."""
    return _write(root, state, backend.save_checkpoint, capture_rng(), keep=keep)


def _write(root: str | Path, state: TrainerState, write_files: Callable[[Path], None], rng: dict, *, keep: int,
           on_read: Callable[[], None] | None = None) -> Path:
    """The atomic write: `write_files(tmp)` (the backend's files), `on_read()` once they are written (the live
    state is no longer read), RNG and state.json, fsync, rename into place, prune to `keep`."""
    if keep < 1:
        raise ValueError(f"checkpoint.keep={keep} must be at least 1")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{_TMP_PREFIX}step-{state.step:010d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write_files(tmp)
        if on_read is not None:
            on_read()
        torch.save(rng, tmp / "rng.pt")
        meta = {"format": FORMAT, "step": state.step, "ledger": state.ledger,
                "last_published_version": state.last_published_version, "extra": state.extra,
                "saved_at": time.time(), "files": _file_sizes(tmp)}
        (tmp / "state.json").write_text(json.dumps(meta))  # last: its presence marks the files complete
        _fsync_tree(tmp)
        final = step_dir(root, state.step)
        if final.exists():  # a step re-saved after resuming from an earlier checkpoint
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


class ReadGate:
    """Closed while a checkpoint write reads the live training state; the optimizer update that would change that
    state waits for it to open (Backend.wait_for_checkpoint_read). `waited_s`: the seconds updates waited."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.waited_s = 0.0

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def wait(self) -> None:
        if not self._open.is_set():
            t0 = time.monotonic()
            self._open.wait()
            self.waited_s += time.monotonic() - t0


class BackgroundSaver:
    """Checkpoints written by a thread from the live state, no copy of it (a copy of the 8 B fleet model's
    optimizer state would need another 62 GiB of host memory): training goes on at once, and only the next
    optimizer update waits, for as long as the write still reads the state (its `ReadGate`). A checkpoint counts
    once complete (renamed into place; a crash before leaves the previous one and a temporary directory the
    next start removes), so nothing is lost. Backends whose state is in other processes write synchronously."""

    def __init__(self, backend: Checkpointable) -> None:
        self.backend, self.gate = backend, ReadGate()
        self.overlaps = backend.attach_checkpoint_gate(self.gate)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: dict = {}
        """The newest finished write: checkpoint/step, /path, /bytes, /write_s, /read_s (the state read)."""

    def start(self, root: str | Path, state: TrainerState, *, keep: int) -> float:
        """Begin the checkpoint of `state` (after the previous one is complete); returns the seconds this blocked."""
        t0 = time.monotonic()
        self.wait()
        rng = capture_rng()
        files = self.backend.checkpoint_files() if self.overlaps else None
        if files is None:
            self._save(root, state, self.backend.save_checkpoint, rng, keep, t0)
            return time.monotonic() - t0
        self.gate.close()
        self._thread = threading.Thread(target=self._run, args=(root, state, files, rng, keep), daemon=True,
                                        name=f"checkpoint-{state.step}")
        self._thread.start()
        return time.monotonic() - t0

    def _run(self, root, state: TrainerState, files: dict, rng: dict, keep: int) -> None:
        def write_files(tmp: Path) -> None:
            for name, obj in files.items():
                torch.save(obj, tmp / name)

        try:
            self._save(root, state, write_files, rng, keep, time.monotonic())
        except BaseException as e:  # noqa: BLE001 - raised by the next start or wait, in the learner's thread
            self._error = e
        finally:
            self.gate.open()

    def _save(self, root, state: TrainerState, write_files, rng: dict, keep: int, t0: float) -> None:
        read: list[float] = []
        path = _write(root, state, write_files, rng, keep=keep, on_read=lambda: (read.append(time.monotonic()),
                                                                                 self.gate.open()))
        self.last = {"checkpoint/step": state.step, "checkpoint/path": str(path),
                     "checkpoint/bytes": sum(_file_sizes(path).values()),
                     "checkpoint/read_s": round(read[0] - t0, 3), "checkpoint/write_s": round(time.monotonic() - t0, 3)}

    def wait(self) -> None:
        """Until the write in flight is complete; raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found) if (p / "state.json").is_file()]


def clean_partial(root: str | Path) -> list[Path]:
    """Remove temporary directories a crashed save left behind; returns what was removed."""
    root = Path(root)
    removed = [p for p in root.glob(f"{_TMP_PREFIX}*") if p.is_dir()] if root.is_dir() else []
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def read_state(path: str | Path) -> TrainerState:
    meta = json.loads((Path(path) / "state.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, this learner reads {FORMAT}")
    return TrainerState(step=int(meta["step"]), ledger=meta["ledger"],
                        last_published_version=meta["last_published_version"], extra=meta.get("extra", {}))


def _file_sizes(path: Path) -> dict[str, int]:
    """Every file of a checkpoint directory and its size (recorded in state.json, checked before a load)."""
    return {Path(d, n).relative_to(path).as_posix(): os.path.getsize(os.path.join(d, n))
            for d, _, names in os.walk(path) for n in names if n != "state.json"}


def damage(path: str | Path) -> str | None:
    """Why the checkpoint at `path` cannot be loaded as saved (a file missing or of another size than was
    written: a truncated copy, a full disk), or None. Checkpoints saved before sizes were recorded pass."""
    path = Path(path)
    try:
        files = json.loads((path / "state.json").read_text()).get("files", {})
        read_state(path)
    except (OSError, ValueError, KeyError) as e:
        return f"its state.json does not read back ({type(e).__name__})"
    for name, size in sorted(files.items()):
        try:
            found = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if found != size:
            return f"{name} is {found:,} bytes, {size:,} were written"
    return None


def latest(root: str | Path, skipped: list[str] | None = None) -> Path | None:
    """The newest intact checkpoint (see `damage`), or None; each newer damaged one is described in
    `skipped` (one sentence each)."""
    for path in reversed(list_checkpoints(root)):
        why = damage(path)
        if why is None:
            return path
        if skipped is not None:
            skipped.append(f"checkpoint {path} is damaged ({why}); falling back to the previous one")
    return None


def load(path: str | Path, backend: Checkpointable) -> TrainerState:
    """Restore backend state and RNG from `path`; returns the learner's state."""
    path = Path(path)
    state = read_state(path)
    backend.load_checkpoint(path)
    restore_rng(torch.load(path / "rng.pt", weights_only=True))
    return state


def load_latest(root: str | Path, backend: Checkpointable, skipped: list[str]) -> tuple[Path, TrainerState] | None:
    """Load the newest checkpoint that is intact and loads, falling back past damaged ones (each described
    in `skipped`, to be said to the user); None when there is none (a fresh start). When every one is
    damaged, a CheckpointError: starting over from the base under a run that went on would be wrong."""
    candidates = list(reversed(list_checkpoints(root)))
    for path in candidates:
        why = damage(path)
        if why is None:
            try:  # damage the sizes cannot see (bits flipped in place) shows as the loader's own error
                return path, load(path, backend)
            except ValueError:
                raise  # the checkpoint is whole but of another plan (tensor_parallel, optimizer): say that
            except Exception as e:  # noqa: BLE001 - torch, pickle and safetensors raise many kinds
                why = f"it does not load: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        skipped.append(f"checkpoint {path} is damaged ({why}); falling back to the previous one")
    if candidates:
        raise CheckpointError(f"every checkpoint under {root} is damaged ({'; '.join(skipped)}): restore one, "
                              "or choose a new RUN to start fresh")
    return None
