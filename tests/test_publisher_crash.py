"""Crash test: SIGKILL a real publisher process at random instants; the bucket always verifies, the pointer
never regresses, and a restarted publisher continues at a higher version."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from weightsync_helpers import make_run

from worker_contract import signing
from worker_contract.anchor import write_anchor
from worker_contract.pointer import read_pointer
from worker_contract.store.file import FileStore
from worker_contract.verify import verify_run

CHILD = Path(__file__).resolve().parent / "publisher_child.py"


def test_sigkill_at_random_points_leaves_a_verifiable_bucket(tmp_path):
    store = FileStore(tmp_path / "bucket")
    key = signing.generate_private_key()
    key_path = tmp_path / "run.key"
    signing.save_private_key(key, key_path)
    manifest, _ = make_run(store, key=key, anchor_interval=3)
    rng = random.Random(20261130)
    last_pointer = 0
    trials = 7
    trials_that_published = 0
    tmp_dir = tmp_path / "tmp"  # the children's anchor shards, before upload: a killed one leaves its shard
    tmp_dir.mkdir()
    for trial in range(trials):
        proc = subprocess.Popen([sys.executable, str(CHILD), store.url, manifest.run, str(key_path), str(trial)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "TMPDIR": str(tmp_dir)})
        try:
            # the kill instant counts from the child's "ready", not from its start: under a loaded CI the
            # interpreter's start-up alone can take longer than a fixed delay
            assert proc.stdout.readline() == "ready\n", proc.stderr.read()
            time.sleep(rng.uniform(0.05, 2.5))
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, err
        lines = []
        ok = verify_run(store, manifest.run, out=lines.append)
        assert ok, "\n".join(lines)
        pointer, _ = read_pointer(store, manifest.run, manifest.trainer_public_key)
        published = [int(x.split()[1]) for x in out.splitlines() if x.startswith("published")]
        if pointer is not None:
            assert pointer.version >= last_pointer, "the pointer moved backwards"
            if published:  # what the child reported as published is visible, and a restart went higher
                assert pointer.version >= max(published)
                assert min(published) > last_pointer or (trial == 0 and min(published) == 1)
            last_pointer = pointer.version
        trials_that_published += bool(published)
    # each restart that published anything published at least its anchor, at a higher version than before
    assert last_pointer >= trials_that_published
    assert trials_that_published >= 3, "too few trials got as far as a publish to test a restart"


def test_an_anchor_write_sweeps_only_shards_of_writers_that_run_no_more(tmp_path, monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"stoa-anchor-{gone.pid}-abc.safetensors"
    live = tmp_path / f"stoa-anchor-{os.getpid()}-def.safetensors"
    other = tmp_path / "stoa-anchor-notes.txt"  # not a shard name: never touched
    for p in (dead, live, other):
        p.write_bytes(b"x")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    store = FileStore(tmp_path / "bucket")
    key = signing.generate_private_key()
    write_anchor(store, "r", 1, "bf16", {"w": np.ones(4, np.float32)}, key)
    assert not dead.exists() and live.exists() and other.exists()
