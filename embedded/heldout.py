"""Held-out evaluation of published versions, for the embedded run.

It reads weights the way a worker does (the verifying reconstructor: signatures and digests checked), so
what it scores is exactly what the bucket serves, and it scores with the task's own reward on the task's
test split, problems that never appear in supervised or RL training. Runs in a thread of the launcher;
each result is one row of the run's metrics.jsonl: step, eval/accuracy, eval/version, eval/problems.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from worker_contract import layout
from worker_contract.store import NotFound, Store

log = logging.getLogger(__name__)


def append_row(path: Path, row: dict) -> None:
    """One JSON line in a single O_APPEND write, so rows of two writers (learner, this) never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(row, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


class HeldoutEvaluator:
    def __init__(self, store: Store, run: str, plane: str, model_dir: str | Path, task, *, problems: int,
                 max_new_tokens: int, temperature: float | None, metrics_path: Path, threads: int = 1):
        self.store, self.run, self.plane, self.model_dir = store, run, plane, Path(model_dir)
        self.threads = threads  # CPU threads: it scores in float32 on the CPU, as the local workers sample
        self.task = task
        self.problems = list(task.dataset("test")[:problems])
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.metrics_path = metrics_path
        self.results: list[dict] = []
        self.error: str | None = None
        self._wake, self._stop = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self._rec = self._policy = None
        self._thread = threading.Thread(target=self._loop, name="heldout-eval", daemon=True)

    @property
    def busy(self) -> bool:
        """An evaluation is running or asked for."""
        return self._lock.locked() or self._wake.is_set()

    @property
    def version(self) -> int | None:
        """The newest version this evaluator holds."""
        return self._rec.version if self._rec is not None else None

    # -- control -------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def request(self) -> None:
        """Evaluate the newest published version soon (requests made while busy collapse into one)."""
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=600)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.evaluate_newest()
            except Exception as e:  # evaluation is advisory: report it, never take the run down
                self.error = f"{type(e).__name__}: {e}"
                log.warning("held-out evaluation failed: %s", self.error)

    # -- work ----------------------------------------------------------------------------------------
    def evaluate_newest(self) -> dict | None:
        """Score the newest published version unless it was scored already; returns the row (or None)."""
        with self._lock:
            version, state = self._sync()
            if version is None or any(r["eval/version"] == version for r in self.results):
                return None
            self._policy.load(self._dense(state))
            t0 = time.monotonic()
            scored = self._score()  # the accuracy, or a task's eval/* fields (embedded/psqa.py)
            fields = scored if isinstance(scored, dict) else {"eval/accuracy": scored}
            row = {"step": self._step_of(version), "time": time.time(), **fields,
                   "eval/version": version, "eval/problems": len(self.problems),
                   "eval/seconds": round(time.monotonic() - t0, 2)}
            self.results.append(row)
            append_row(self.metrics_path, row)
            return row

    def _sync(self):
        """(version, plane state) of the newest published version; (None, None) before the first."""
        from worker_contract.reconstruct import Reconstructor, SyncError

        if self._rec is None:
            from worker_contract.worker.model import PolicyModel

            rec = Reconstructor(self.store, self.run, plane=self.plane)
            try:
                rec.join()
            except SyncError:
                return None, None  # nothing published yet: try again on the next request
            self._rec = rec
            if self._policy is None:
                self._policy = PolicyModel(self.model_dir, threads=self.threads, device="cpu",  # float32, as workers
                                           record_routes=False)
        else:
            self._rec.follow()
        return self._rec.version, self._rec.state

    def _dense(self, state):
        from worker_contract.planes import get_plane

        return get_plane(self.plane).to_dense(state)

    def _step_of(self, version: int) -> int | None:
        """The learner step whose weights a version holds (from the version's stats object)."""
        for _ in range(20):  # the learner writes the stats object just after it moves the pointer
            try:
                return int(json.loads(self.store.get(layout.stats_key(self.run, version)))["step"])
            except NotFound:
                time.sleep(0.25)
            except (ValueError, KeyError, TypeError):
                return None
        return None

    def _score(self) -> float:
        from .basemodel import evaluate

        p = self._policy
        greedy = self.temperature is None
        return evaluate(p.model, p.tokenizer, self.task, self.problems, max_new_tokens=self.max_new_tokens,
                        temperature=self.temperature or 1.0, greedy=greedy, batch_size=100)
