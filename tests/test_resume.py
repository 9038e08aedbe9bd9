"""Checkpoints and resume: exact state round trip, atomic saves under SIGKILL, and the learner killed
(a real process, SIGKILL) between and during steps, after which every invariant holds: versions only
grow and none is reused, the pointer never moves back, and no group counts past the reuse cap along the
lineage that survives."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from learner_fixtures import make_record, recipe, save_tiny_model

from trainer import checkpoint
from trainer.backends import get_backend
from trainer.objectives import policy_loss
from trainer.step import collate

torch.set_num_threads(1)
PROC = Path(__file__).resolve().parent / "learner_proc.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def _step(backend, cfg, seed):
    batch = collate([make_record("r", 1, "w", f"g{seed}", random.Random(seed))])
    batch.ref_logp = backend.logprobs(batch, reference=True)
    return backend.train_step(batch, lambda lp, mb: policy_loss(lp, mb.behavior_logp, mb.ref_logp, mb.advantages,
                                                                mb.loss_mask, cfg.algo))


def test_checkpoint_round_trip_restores_model_optimizer_rng_and_state(model_dir, tmp_path):
    cfg = recipe()
    a = get_backend("hf").load(model_dir, cfg, device="cpu")
    for seed in range(2):
        _step(a, cfg, seed)
    ledger = {"version": 1, "reuse_cap": 2, "uses": {"run/rollouts/v0000000002/w/g.json.zst": 2}}
    torch.manual_seed(5)
    random.seed(5)
    path = checkpoint.save(tmp_path, checkpoint.TrainerState(step=2, ledger=ledger, last_published_version=3), a)
    expect_rand = (torch.rand(3), random.random())
    after_a = _step(a, cfg, 9)

    b = get_backend("hf").load(model_dir, cfg, device="cpu")
    state = checkpoint.load(checkpoint.latest(tmp_path), b)
    assert path.name == "step-0000000002"
    assert (state.step, state.ledger, state.last_published_version) == (2, ledger, 3)
    assert torch.equal(torch.rand(3), expect_rand[0]) and random.random() == expect_rand[1]
    after_b = _step(b, cfg, 9)  # same weights and same Adam moments give the same next step
    assert after_a["loss"] == after_b["loss"] and after_a["grad_norm"] == after_b["grad_norm"]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict_hf().values(), b.state_dict_hf().values(), strict=True))


def test_only_the_newest_and_one_previous_are_kept(model_dir, tmp_path):
    cfg = recipe()
    backend = get_backend("hf").load(model_dir, cfg, device="cpu")
    for step in (2, 4, 6, 8):
        checkpoint.save(tmp_path, checkpoint.TrainerState(step, {"version": 1, "uses": {}}, step), backend)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-0000000006", "step-0000000008"]
    (tmp_path / "step-0000000010").mkdir()  # no state.json: not a checkpoint
    assert checkpoint.latest(tmp_path).name == "step-0000000008"
    with pytest.raises(ValueError, match="checkpoint.keep=0"):
        checkpoint.save(tmp_path, checkpoint.TrainerState(9, {}, 9), backend, keep=0)


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.NoSuchProcess:
        return ""


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


#: Ray's agents report a dead raylet to the GCS with a hard-coded 60 s timeout before they exit; the GCS
#: died with the trainer, so they linger that long. They are killed by PID instead of waited for.
SLOW_TO_EXIT = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _kill_tree(proc: subprocess.Popen, kids: list[psutil.Process], wait_s: float = 30.0) -> list[str]:
    """SIGKILL the process we started, then wait for the processes it started; any left (but Ray's
    slow agents) are killed by PID and returned, so a test can say whether they went on their own."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs([p for p in kids if _name(p) not in SLOW_TO_EXIT], timeout=wait_s)
    for p in [p for p in kids if _name(p) in SLOW_TO_EXIT]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    left = []
    for p in alive:
        try:
            left.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
            p.kill()
        except psutil.NoSuchProcess:
            continue
    return left


def test_sigkill_during_saves_never_leaves_a_broken_newest_checkpoint(model_dir, tmp_path):
    root = tmp_path / "ckpt"
    hit_mid_save = False
    for attempt in range(6):
        proc = subprocess.Popen([sys.executable, str(PROC), "save-loop", str(root), str(model_dir)],
                                stdout=subprocess.PIPE, text=True)
        saved = 0
        while saved < 2:  # let it finish a couple of saves, then kill it at a random point of the next
            line = proc.stdout.readline()
            assert line, "the save loop died on its own"
            saved += line.startswith("SAVED")
        time.sleep(random.Random(attempt).uniform(0.0, 0.05))
        _kill_tree(proc, [])
        proc.stdout.close()
        hit_mid_save |= any(p.name.startswith(".tmp-") for p in root.iterdir())
        newest = checkpoint.latest(root)
        assert newest is not None
        state = checkpoint.read_state(newest)
        backend = get_backend("hf").load(model_dir, recipe(), device="cpu")
        checkpoint.load(newest, backend)  # every file of the newest checkpoint reads back
        assert state.ledger["uses"]["k"] == state.step
        checkpoint.clean_partial(root)
        assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
        assert len(checkpoint.list_checkpoints(root)) <= 3  # pruning may be cut short by the kill
        if hit_mid_save:
            break
    assert hit_mid_save, "no kill landed inside a save; the test did not exercise what it claims"


# -- the learner loop, killed and restarted ------------------------------------------------------------
class Trainer:
    """tests/learner_proc.py learn ... as a real process, its stdout read line by line in a thread."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path):
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen([sys.executable, str(PROC), "learn", *args], stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.steps: list[dict] = []
        self.done: dict | None = None

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def next_event(self, timeout: float) -> str | None:
        """'step', 'done', 'exit', or None when nothing came within `timeout` seconds."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        if line is None:
            return "exit"
        if line.startswith("STEP "):
            self.steps.append(json.loads(line[5:]))
            return "step"
        if line.startswith("DONE "):
            self.done = json.loads(line[5:])
            return "done"
        return self.next_event(timeout)

    def wait_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not self.steps or self.steps[-1]["step"] < step:
            ev = self.next_event(max(0.1, deadline - time.monotonic()))
            assert ev not in (None, "exit", "done"), f"trainer stopped before step {step}: {ev}, {self.steps}"

    def wait_idle(self, quiet_s: float, timeout: float = 240) -> None:
        """Until no step has finished for `quiet_s` seconds (the learner is waiting for rollouts)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ev = self.next_event(quiet_s)
            if ev is None:
                return
            assert ev == "step", f"trainer ended while it should be waiting: {ev}"
        raise AssertionError("the trainer never went idle")

    def kill(self) -> list[str]:
        kids = _descendants(self.proc.pid)
        left = _kill_tree(self.proc, kids)
        self.log.close()
        return left


def _remove_ray_tmp(run_dir: Path) -> None:
    """A killed trainer cannot remove Ray's short temp dir outside the run dir; the test does."""
    import shutil

    note = run_dir / "ray.path"
    if note.exists():
        shutil.rmtree(note.read_text().strip(), ignore_errors=True)


def _versions_in_bucket(store, run: str) -> set[int]:
    from worker_contract import layout

    found = {layout.patch_version_of(k) for k in store.list_keys(layout.versions_prefix(run))}
    found |= {int(k.split("/")[2][1:]) for k in store.list_keys(layout.anchors_prefix(run))}
    return {v for v in found if v is not None}


def _lineage(rows: list[dict]) -> dict[int, list]:
    """step -> the groups it used, along the lineage that survives: a row whose step is not past the
    previous one starts a resumed session, which discards every later step of the dead one."""
    steps: dict[int, list] = {}
    for row in rows:
        for s in [s for s in steps if s >= row["step"]]:
            del steps[s]
        steps[row["step"]] = row["rollout/groups"]
    return steps


@pytest.mark.slow
@pytest.mark.integration
def test_learner_killed_during_and_between_steps_resumes_with_every_invariant(model_dir, tmp_path, request):
    from learner_fixtures import make_record, manifest, put_record, tiny_model

    from trainer.metrics import read_metrics
    from trainer.publish.publisher import Publisher
    from worker_contract import layout
    from worker_contract.manifest import create_or_resume
    from worker_contract.signing import generate_private_key, save_private_key
    from worker_contract.store.file import FileStore

    run, home = "resume", tmp_path / "home"
    home.mkdir()
    request.addfinalizer(lambda: _remove_ray_tmp(tmp_path / "run"))
    store = FileStore(tmp_path / "bucket")
    key = generate_private_key()
    save_private_key(key, tmp_path / "run.key")
    # a window wide enough that every group stays usable all test long: the reuse cap, not staleness,
    # is what retires groups, so a resumed learner that forgot its ledger would use some a third time
    staleness = 50
    man = create_or_resume(store, manifest(run, key, staleness=staleness), resume=False)
    pub = Publisher(store, man, key, anchor_interval=3)
    base, rng = tiny_model(seed=0), random.Random(3)

    def feed(versions):
        for v in versions:
            for w in ("w1", "w2"):
                put_record(store, make_record(run, v, w, f"g{v}", rng, model=base))

    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    args = [str(tmp_path / "bucket"), str(tmp_path / "run"), str(model_dir), str(tmp_path / "run.key"), run]
    pointers: list[int] = []
    sessions: list[tuple[int, set[int]]] = []  # (pointer before the start, versions in the bucket then)

    def start(num_steps: int) -> Trainer:
        sessions.append((pub.current_version() or 0, _versions_in_bucket(store, run)))
        return Trainer([*args, str(num_steps), str(staleness)], env, tmp_path / "trainer.log")

    def after_kill(trainer: Trainer) -> None:
        assert trainer.kill() == [], "Ray processes outlived the trainer they belong to"
        pointers.append(pub.current_version())

    ckpts = tmp_path / "run" / "checkpoints"
    newest = lambda: checkpoint.read_state(checkpoint.latest(ckpts)).step  # noqa: E731

    feed(range(1, 5))
    # 1: killed during a step: the moment step 3 is reported the driver is already inside step 4, and
    # the newest checkpoint is step 2's, so step 3 is work the surviving lineage will not have
    t1 = start(30)
    t1.wait_step(3)
    after_kill(t1)
    assert newest() == 2 and t1.steps[-1]["step"] == 3
    # 2: resumes from step 2; runs until the 8 groups are used up (twice each: 8 steps) and it waits for
    # more; killed there, between steps
    t2 = start(30)
    t2.wait_step(4)
    t2.wait_idle(quiet_s=4.0)
    after_kill(t2)
    resume_at = newest()
    assert t2.steps[0]["step"] == 3 and t2.steps[-1]["step"] == 8 == resume_at
    # 3: more rollouts arrive; resumes and finishes
    feed(range(5, 40))
    t3 = start(resume_at + 4)
    while t3.next_event(240) not in ("done", "exit", None):
        pass
    assert t3.proc.wait(timeout=60) == 0 and t3.done is not None
    t3.log.close()
    pointers.append(pub.current_version())
    assert t3.steps[0]["step"] == resume_at + 1 and t3.done["resumed_from"].endswith(f"step-{resume_at:010d}")

    # versions only grow and none is reused: each session's anchor is above everything already there
    first_versions = [t.steps[0]["version"] for t in (t1, t2, t3)]
    for (pointer, existing), first in zip(sessions, first_versions, strict=True):
        assert first > pointer and first > max(existing, default=0), (pointer, existing, first)
    assert pointers == sorted(pointers) and t3.done["version"] == pointers[-1] == pub.current_version()
    for t in (t1, t2, t3):
        versions = [s["version"] for s in t.steps]
        assert versions == sorted(versions)
    # no group counts past the reuse cap along the lineage that survives, and the checkpoint agrees
    lineage = _lineage(read_metrics(tmp_path / "run"))
    assert sorted(lineage) == list(range(1, t3.done["step"] + 1))
    uses: dict[str, int] = {}
    for groups in lineage.values():
        for key_, use in groups:
            uses[key_] = uses.get(key_, 0) + 1
            assert use == uses[key_]  # the source's own count matches the lineage's
    assert max(uses.values()) <= 2
    final = checkpoint.read_state(checkpoint.latest(tmp_path / "run" / "checkpoints"))
    assert final.step == t3.done["step"]
    assert all(uses[k] == n for k, n in final.ledger["uses"].items())
    low = t3.done["version"] - staleness
    assert all(layout.parse_rollout_key(k).version < low for k in set(uses) - set(final.ledger["uses"]))
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert list(home.iterdir()) == []


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(model_dir, tmp_path):
    """The newest checkpoint's model.pt cut in half (a full disk, a copy cut short): resuming takes the previous
    one, says so in one sentence, and restores its weights exactly; a checkpoint saved before sizes were
    recorded is caught by its load failing instead; with every checkpoint damaged, one sentence refusal."""
    cfg = recipe()
    a = get_backend("hf").load(model_dir, cfg, device="cpu")
    _step(a, cfg, 0)
    checkpoint.save(tmp_path, checkpoint.TrainerState(step=1, ledger={}, last_published_version=2), a)
    at_step1 = {k: v.clone() for k, v in a.state_dict_hf().items()}
    _step(a, cfg, 1)
    newest = checkpoint.save(tmp_path, checkpoint.TrainerState(step=2, ledger={}, last_published_version=3), a)
    model_pt = newest / "model.pt"
    with open(model_pt, "r+b") as f:
        f.truncate(model_pt.stat().st_size // 2)

    b = get_backend("hf").load(model_dir, cfg, device="cpu")
    path = checkpoint.latest(tmp_path)
    state = checkpoint.load(path, b)  # what resume does: the newest checkpoint that is intact
    assert state.step == 1 and path.name == "step-0000000001"
    skipped: list[str] = []
    assert checkpoint.latest(tmp_path, skipped) == path
    assert len(skipped) == 1 and "step-0000000002 is damaged (model.pt is" in skipped[0], skipped
    assert "falling back to the previous one" in skipped[0]
    assert all(torch.equal(at_step1[k], v) for k, v in b.state_dict_hf().items())

    # an older checkpoint with no recorded sizes: the load itself fails, and load_latest goes on past it
    meta = json.loads((newest / "state.json").read_text())
    del meta["files"]
    (newest / "state.json").write_text(json.dumps(meta))
    assert checkpoint.latest(tmp_path) == newest
    skipped = []
    path, state = checkpoint.load_latest(tmp_path, get_backend("hf").load(model_dir, cfg, device="cpu"), skipped)
    assert state.step == 1 and len(skipped) == 1 and "does not load" in skipped[0], skipped

    (tmp_path / "step-0000000001" / "rng.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="every checkpoint under .* is damaged"):
        checkpoint.load_latest(tmp_path, b, [])
