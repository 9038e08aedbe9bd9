"""What the reliability tests check about a bucket, in one place.

    BucketWatcher(store, run, public_key)   a reader polling the run while writers work: it reads every
                                            object it lists, follows every pointer it sees with the real
                                            reconstructor, and remembers what it saw
    watcher.problems(final_store)           every partial or changed create-only object it saw, every
                                            pointer that moved back, every pointer it could not follow
    verify_all(store, run)                  `verify_run` over every version, with its report lines
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field

from worker_contract import layout
from worker_contract.pointer import PointerError, parse_pointer
from worker_contract.reconstruct import Reconstructor, SyncError
from worker_contract.store import NotFound, Store, StoreError
from worker_contract.verify import verify_run


@dataclass
class Seen:
    digests: dict[str, set[str]] = field(default_factory=dict)
    """key -> sha256 of every content read from it (create-only keys must show exactly one, the final one)."""
    pointers: list[int] = field(default_factory=list)
    """Pointer versions in the order they were read."""
    followed: list[int] = field(default_factory=list)
    """Versions the reconstructor reached (each verified against the pointer's digest)."""
    named: dict[int, set[str]] = field(default_factory=dict)
    """version -> every state digest a pointer named for it (a reused version number would show two)."""
    problems: list[str] = field(default_factory=list)
    reads: int = 0
    polls: int = 0


class BucketWatcher(threading.Thread):
    """A concurrent reader: partial objects, regressions and unfollowable pointers are what it looks for."""

    def __init__(self, store: Store, run: str, public_key: str, *, interval_s: float = 0.02,
                 follow: bool = True, plane: str = "bf16", rollouts: bool = True):
        super().__init__(daemon=True)
        self.store, self.run_id, self.public_key = store, run, public_key
        self.interval_s, self.follow, self.plane = interval_s, follow, plane
        # the trainer's objects always; workers' rollouts too unless there are too many to re-list
        self.prefixes = [layout.run_prefix(run)] if rollouts else [
            layout.pointer_key(run), layout.manifest_key(run), layout.anchors_prefix(run), layout.versions_prefix(run)]
        self.stop_event = threading.Event()
        self.seen = Seen()
        self._rec: Reconstructor | None = None

    def __enter__(self) -> BucketWatcher:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.join(timeout=60)

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.poll()
            except StoreError:
                pass  # a reader meeting a flaky store retries; only what it reads is judged
            except Exception as e:  # anything else is a finding, not a crash of the watcher
                self.seen.problems.append(f"watcher: {type(e).__name__}: {e}")
            self.stop_event.wait(self.interval_s)

    def poll(self) -> None:
        s = self.seen
        s.polls += 1
        for key in [k for prefix in self.prefixes for k in self.store.list_keys(prefix)]:
            if key in s.digests and key != layout.pointer_key(self.run_id):
                continue  # create-only objects are read once; the final check compares them
            try:
                data = self.store.get(key)
            except NotFound:
                continue  # deleted between list and get (gc, stats rewrite): not a partial object
            s.reads += 1
            s.digests.setdefault(key, set()).add(hashlib.sha256(data).hexdigest())
            if key == layout.pointer_key(self.run_id):
                self._pointer(data)

    def _pointer(self, data: bytes) -> None:
        s = self.seen
        try:
            p = parse_pointer(data, self.run_id, self.public_key)
        except PointerError as e:
            s.problems.append(f"unreadable pointer: {e}")
            return
        if s.pointers and p.version < s.pointers[-1]:
            s.problems.append(f"pointer moved back from v{s.pointers[-1]} to v{p.version}")
        s.pointers.append(p.version)
        s.named.setdefault(p.version, set()).add(p.result_digest)
        if not self.follow or (s.followed and s.followed[-1] >= p.version):
            return
        try:
            if self._rec is None:
                self._rec = Reconstructor(self.store, self.run_id, plane=self.plane, public_key=self.public_key)
            got = self._rec.follow()
            if got is not None:
                s.followed.append(got[0])
        except SyncError as e:
            s.problems.append(f"could not follow the pointer to v{p.version}: {e}")

    def problems(self, final: Store | None = None, overwritten: tuple[str, ...] = ("stats/",)) -> list[str]:
        """The watcher's findings, plus every create-only object whose content it saw differ from the final
        object (a partial or replaced object). `overwritten` names key parts that may legally change."""
        final = final or self.store
        out = list(self.seen.problems)
        out += [f"v{v} was named with {len(d)} different states" for v, d in self.seen.named.items() if len(d) > 1]
        for key, digests in self.seen.digests.items():
            if key == layout.pointer_key(self.run_id) or any(part in key for part in overwritten):
                continue
            try:
                now = hashlib.sha256(final.get(key)).hexdigest()
            except NotFound:
                continue  # removed since (gc): its content was judged when read
            if digests != {now}:
                out.append(f"{key}: a reader saw content other than the final object (partial or replaced)")
        return out


def verify_all(store: Store, run: str) -> tuple[bool, list[str]]:
    lines: list[str] = []
    ok = verify_run(store, run, out=lines.append)
    return ok, lines
