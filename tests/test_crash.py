"""Crash: the trainer (tests/learner_proc.py learn: the real learner loop on Ray, a real process tree) is
killed with SIGKILL, every process of it at once, at random points of each phase (consuming rollouts,
stepping, publishing, checkpointing), then restarted, again and again on one run while workers keep
uploading. After every kill the bucket verifies version by version from its anchors; a reader polling
all along never sees a partial object or a pointer it cannot follow, and the pointer never moves back;
every restart publishes above everything already there (no version number reused, and each version
number only ever names one state); along the lineage that survives, no group is used past the reuse cap.

The CI test runs one trial per phase; `nox -s soak` runs DRL_SOAK_TRIALS (default 20) of them.
"""

from __future__ import annotations

import json
import os
import pwd
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from invariants import BucketWatcher, verify_all
from learner_fixtures import make_record, manifest, put_record, save_tiny_model
from soakstats import record, soak_trials
from test_resume import Trainer, _lineage, _remove_ray_tmp, _versions_in_bucket

from trainer import checkpoint
from trainer.metrics import read_metrics
from worker_contract.manifest import create_or_resume
from worker_contract.pointer import read_pointer
from worker_contract.signing import generate_private_key, save_private_key
from worker_contract.store.file import FileStore

PHASES = ("consume", "step", "publish", "checkpoint")
REUSE_CAP = 2  # learner_fixtures.recipe
STALENESS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


class Feeder(threading.Thread):
    """Two workers uploading a fresh group each at the pointer's version every `every_s` (unless paused)."""

    def __init__(self, store: FileStore, run: str, public_key: str, every_s: float = 0.4):
        super().__init__(daemon=True)
        self.store, self.run_id, self.public_key, self.every_s = store, run, public_key, every_s
        self.stop, self.paused = threading.Event(), threading.Event()
        self.rng, self.n = random.Random(5), 0

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            if self.paused.is_set():
                continue
            pointer, _ = read_pointer(self.store, self.run_id, self.public_key)
            if pointer is None:
                continue
            self.n += 1
            for w in ("w1", "w2"):
                put_record(self.store, make_record(self.run_id, pointer.version, w, f"g{self.n}", self.rng))


def kill_all(trainer: Trainer) -> int:
    """SIGKILL the trainer's whole process tree at once (the driver and every Ray process), as a crash of
    the box would; each by PID. Returns how many processes were killed."""
    procs = [psutil.Process(trainer.proc.pid), *psutil.Process(trainer.proc.pid).children(recursive=True)]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    trainer.proc.wait(timeout=60)
    _, alive = psutil.wait_procs(procs[1:], timeout=60)
    assert not alive, f"processes survived SIGKILL: {alive}"
    trainer.log.close()
    return len(procs)


class Run:
    """One run that is crashed over and over; the test's view of it."""

    def __init__(self, tmp_path: Path, model_dir: Path):
        self.tmp, self.run_dir = tmp_path, tmp_path / "run"
        self.store = FileStore(tmp_path / "bucket")
        self.key = generate_private_key()
        save_private_key(self.key, tmp_path / "run.key")
        self.man = create_or_resume(self.store, manifest("crash", self.key, staleness=STALENESS), resume=False)
        self.args = [str(tmp_path / "bucket"), str(self.run_dir), str(model_dir), str(tmp_path / "run.key"), "crash"]
        self.home = tmp_path / "home"  # the trainer's processes get an empty HOME; it must stay empty
        self.home.mkdir()
        self.env = {**os.environ, "HOME": str(self.home), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        self.pointers: list[int] = []
        self.starts: list[tuple[int, int, int]] = []  # (pointer before, newest version in the bucket, first)
        self.leftovers: set[str] = set()  # publish files that crashed attempts left

    def pointer(self) -> int:
        p, _ = read_pointer(self.store, "crash", self.man.trainer_public_key)
        return p.version if p else 0

    def start(self, num_steps: int = 100_000) -> Trainer:
        before, existing = self.pointer(), max(_versions_in_bucket(self.store, "crash"), default=0)
        resume_at = self.newest_checkpoint()
        t = Trainer([*self.args, str(num_steps), str(STALENESS)], self.env, self.tmp / "trainer.log")
        try:
            t.wait_step(resume_at + 1)  # setup done: a fresh anchor is published, one step taken
        except BaseException:  # a start that fails the test must not outlive it (it would train for hours)
            kill_all(t)
            raise
        self.leftovers = {f for f in self.publish_files() if "/.tmp-" in f}
        self.starts.append((before, existing, t.steps[0]["version"]))
        return t

    def newest_checkpoint(self) -> int:
        path = checkpoint.latest(self.run_dir / "checkpoints")
        return checkpoint.read_state(path).step if path else 0

    # -- what "inside a phase" looks like from outside ---------------------------------------------------
    def checkpointing(self) -> bool:
        ckpts = self.run_dir / "checkpoints"
        return ckpts.is_dir() and any(p.name.startswith(".tmp-") for p in ckpts.iterdir())

    def publish_files(self) -> set[str]:
        """Objects of versions the pointer does not name (yet), and file store temp files being written."""
        root = self.store.root / "crash"
        pointer, out = self.pointer(), set()
        vdir = root / "versions"
        for p in vdir.iterdir() if vdir.is_dir() else ():
            if p.name.startswith(".tmp-") or (p.suffix == ".pulse" and int(p.name[1:11]) > pointer):
                out.add(str(p))
        adir = root / "anchors"
        for d in adir.iterdir() if adir.is_dir() else ():
            out |= {str(p) for p in d.iterdir() if int(d.name[1:]) > pointer or p.name.startswith(".tmp-")}
        return out

    def publishing(self) -> bool:
        """A publish in progress: publish files other than what earlier crashes left (their temp files stay)."""
        return bool(self.publish_files() - self.leftovers)


def wait_for(cond, timeout_s: float, every_s: float = 0.001) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return True
        except (FileNotFoundError, ValueError, json.JSONDecodeError):
            pass  # a directory or pointer changing under the scan
        time.sleep(every_s)
    return False


def crash_once(run: Run, trainer: Trainer, feeder: Feeder, phase: str, rng: random.Random) -> bool:
    """Kill the trainer inside `phase`; True when it was seen inside the phase right before the kill
    (for publish and checkpoint: their unfinished files on disk, polled every millisecond)."""
    if phase == "consume":  # workers go quiet; the learner drains the pool and polls the bucket for more
        feeder.paused.set()
        trainer.wait_idle(quiet_s=2.0)
        time.sleep(rng.uniform(0.0, 1.0))
        hit = True
    elif phase == "step":  # the moment a step is reported, the driver is already in the next one
        trainer.wait_step(trainer.steps[-1]["step"] + 1)
        time.sleep(rng.uniform(0.0, 0.2))
        hit = True
    else:
        hit = wait_for(run.publishing if phase == "publish" else run.checkpointing, timeout_s=90)
    kill_all(trainer)
    feeder.paused.clear()
    return hit


def check_at_rest(run: Run) -> None:
    """The bucket right after a crash: it verifies whole, and the pointer did not move back."""
    ok, lines = verify_all(run.store, "crash")
    assert ok, "\n".join(lines)
    run.pointers.append(run.pointer())
    assert run.pointers == sorted(run.pointers), run.pointers


def crash_trials(tmp_path: Path, model_dir: Path, trials: int, seed: int) -> dict:
    run = Run(tmp_path, model_dir)
    rng = random.Random(seed)
    phases = [PHASES[i % len(PHASES)] for i in range(trials)]
    rng.shuffle(phases)
    hits: Counter = Counter()
    left_behind: Counter = Counter()
    killed = 0
    feeder = Feeder(run.store, "crash", run.man.trainer_public_key)
    try:
        with BucketWatcher(run.store, "crash", run.man.trainer_public_key, interval_s=0.05,
                           rollouts=False) as watcher:
            feeder.start()
            for phase in phases:
                trainer = run.start()
                hits[phase] += crash_once(run, trainer, feeder, phase, rng)
                killed += 1
                left_behind["partial_checkpoint"] += run.checkpointing()
                left_behind["unfinished_publish"] += run.publishing()
                check_at_rest(run)
                _remove_ray_tmp(run.run_dir)
            # a last session runs to its end
            last = run.start(num_steps=run.newest_checkpoint() + 3)
            while last.next_event(240) not in ("done", "exit", None):
                pass
            assert last.proc.wait(timeout=120) == 0 and last.done is not None, "the last session did not finish"
            last.log.close()
            check_at_rest(run)
            feeder.stop.set()
        problems = watcher.problems(run.store)
    finally:
        feeder.stop.set()
        _remove_ray_tmp(run.run_dir)
    assert problems == [], problems
    assert list(run.home.iterdir()) == [], "the trainer wrote into its HOME"
    assert len(set(watcher.seen.pointers)) > trials, "the reader saw too few versions to judge"
    # no version number reused: each start published above everything already in the bucket, and every
    # version object was written once (the reader saw each one's content only as it is now)
    for before, existing, first in run.starts:
        assert first > before and first > existing, (before, existing, first)
    # the reuse cap along the lineage that survives, and the source's own use counts agree with it
    lineage = _lineage(read_metrics(run.run_dir))
    assert sorted(lineage) == list(range(1, last.done["step"] + 1))
    uses: Counter = Counter()
    for groups in lineage.values():
        for key, use in groups:
            uses[key] += 1
            assert use == uses[key], (key, use, uses[key])
    assert max(uses.values()) <= REUSE_CAP
    final = checkpoint.read_state(checkpoint.latest(run.run_dir / "checkpoints"))
    assert all(uses[k] == n for k, n in final.ledger["uses"].items())
    return {"trials": trials, "kills": killed, "targeted": dict(Counter(phases)), "landed": dict(hits),
            "left_behind": dict(left_behind), "versions": run.pointer(), "steps": last.done["step"],
            "groups_used": len(uses), "max_uses": max(uses.values()), "reuse_cap": REUSE_CAP,
            "skipped_versions": sum("interrupted attempt" in line for line in verify_all(run.store, "crash")[1]),
            "pointer_reads": len(watcher.seen.pointers), "followed_versions": len(watcher.seen.followed)}


def test_the_test_and_the_trainer_it_starts_have_a_temporary_home(tmp_path, tmp_path_factory):
    """Neither this test nor the processes it starts may write into the user's home directory."""
    user_home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    assert Path.home() != user_home and Path.home().is_relative_to(tmp_path_factory.getbasetemp())
    run = Run(tmp_path, tmp_path / "model")
    seen = subprocess.run([sys.executable, "-c", "import pathlib; print(pathlib.Path.home())"], env=run.env,
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert seen == str(run.home) and run.home.is_relative_to(tmp_path)


@pytest.mark.slow
@pytest.mark.integration
def test_trainer_killed_in_every_phase_keeps_every_invariant(tmp_path, model_dir):
    figures = crash_trials(tmp_path, model_dir, trials=len(PHASES), seed=11)
    print(figures)
    assert figures["landed"].get("checkpoint", 0) + figures["landed"].get("publish", 0) >= 1, figures


@pytest.mark.soak
def test_soak_crashes(tmp_path, model_dir):
    trials = soak_trials(20)
    figures = crash_trials(tmp_path, model_dir, trials=trials, seed=2026)
    assert all(figures["landed"].get(p, 0) >= 1 for p in PHASES), figures
    record("crash", figures)
