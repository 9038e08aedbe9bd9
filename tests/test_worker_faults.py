"""Worker faults, with the reference worker (worker_contract.worker) as real processes and its real code:

- killed with SIGKILL in the middle of an upload (on a file bucket: while its temporary file exists; on S3:
  while its PUT is in flight, held by the fault proxy), again and again: every object a reader can see is
  a whole record the learner accepts; nothing half-written is visible;
- started on the wrong plane or the wrong group size: it refuses to join (exit 3, naming the value);
- groups sampled on stale weights, or (from a worker that skips the contract check) on the wrong plane or
  at the wrong group size: the learner's rollout source drops each with its reason, counted per worker.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from soakstats import record, soak_trials
from test_worker import RUN as WRUN
from test_worker import (
    N,
    _publish_run,
    _spawn,
    tiny_model_dir,  # noqa: F401  (fixture: a tiny model with a tokenizer)
)

from bench.faultproxy import FaultProxy
from trainer.config import AlgoConfig
from trainer.rollouts.source import RolloutSource
from worker_contract import layout
from worker_contract.schema import decode_record
from worker_contract.store.file import FileStore
from worker_contract.store.s3 import S3Store
from worker_contract.tasks import get_task


def _source(store, man) -> RolloutSource:
    return RolloutSource.from_manifest(store, man, AlgoConfig(staleness=3, reuse_cap=2, groups_per_step=1))


def _worker(store, model_dir, name: str):
    from worker_contract.worker.loop import Worker, WorkerSettings

    settings = WorkerSettings(store=store.url, run=WRUN, model_dir=str(model_dir), worker_id=name, seed=0, threads=1)
    return Worker(settings, env={"DRL_N_SAMPLES": str(N), "DRL_PULSE_PLANE": "bf16"})


def _sigkill(proc) -> None:
    """SIGKILL the worker process (it starts no children; any it did are killed by PID too)."""
    kids = psutil.Process(proc.pid).children(recursive=True)
    for p in [psutil.Process(proc.pid), *kids]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(kids, timeout=30)
    proc.stdout.close()
    proc.stderr.close()


def _wait(cond, timeout_s: float, proc, every_s: float = 0.0005) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        if proc.poll() is not None:
            raise AssertionError(f"the worker exited on its own: {proc.stderr.read()}")
        time.sleep(every_s)
    return False


def _tmp_files(root: Path) -> set[Path]:
    base = root / WRUN / "rollouts"
    return {p for p in base.rglob(".tmp-*")} if base.is_dir() else set()


def kill_mid_upload(store, man, model_dir, *, trials: int, env: dict | None, arm) -> dict:
    """Start a worker, wait until the predicate `arm()` returns says an upload is in progress, SIGKILL it;
    repeat. Then every visible object must be a whole record the source accepts."""
    hits = 0
    rng = random.Random(0)
    for t in range(trials):
        in_upload = arm()
        p = _spawn(store, model_dir, "--worker-id", f"k{t}", env=env)
        try:
            hits += _wait(in_upload, 120, p)
            time.sleep(rng.uniform(0, 0.002))
        finally:
            _sigkill(p)
    keys = store.list_keys(layout.rollouts_prefix(WRUN))
    for k in keys:
        rec = decode_record(store.get(k))  # whole: decodes, follows the schema
        assert len(rec.samples) == N and k.endswith(f"/{rec.group_id}.json.zst")
    src = _source(store, man)
    src.poll(1)
    assert src.accepted == len(keys) and not src.drops, (src.accepted, len(keys), dict(src.drops))
    return {"trials": trials, "kills_inside_upload": hits, "records_visible": len(keys)}


@pytest.mark.integration
def test_worker_killed_mid_upload_leaves_nothing_half_written_file(tmp_path, tiny_model_dir):  # noqa: F811
    store = FileStore(tmp_path / "bucket")
    man, _, _ = _publish_run(store, tiny_model_dir)
    figures = kill_mid_upload(store, man, tiny_model_dir, trials=3, env=None, arm=lambda: _file_uploading(store))
    assert figures["kills_inside_upload"] >= 2, figures
    # what a killed upload leaves is a temporary file no reader lists (the file store skips them)
    assert all(".tmp-" not in k for k in store.list_keys(WRUN + "/"))


def _file_uploading(store: FileStore):
    """A predicate: a new temporary file exists (the file store writes one, fsyncs it, links it into place)."""
    before = _tmp_files(store.root)
    return lambda: bool(_tmp_files(store.root) - before)


def _s3_kill_run(moto_server, model_dir, trials: int) -> dict:
    bucket = moto_server.new_bucket()
    direct = S3Store.from_url(f"s3://{bucket}", moto_server.env())
    man, _, _ = _publish_run(direct, model_dir)
    with FaultProxy(moto_server.endpoint, seed=5, slow_s=30.0) as proxy:
        is_upload = lambda r: r.method == "PUT" and "/rollouts/" in r.path  # noqa: E731
        proxy.inject(["slow"] * trials, match=is_upload)  # the server takes the PUT; the answer is held
        env = moto_server.env(endpoint=proxy.url)
        puts = lambda: len([r for r in proxy.requests("PUT") if is_upload(r)])  # noqa: E731

        def arm():
            before = puts()
            return lambda: puts() > before

        figures = kill_mid_upload(direct, man, model_dir, trials=trials, env=env, arm=arm)
    assert figures["kills_inside_upload"] == trials, figures
    return figures


@pytest.mark.integration
def test_worker_killed_mid_upload_leaves_nothing_half_written_s3(moto_server, tiny_model_dir):  # noqa: F811
    _s3_kill_run(moto_server, tiny_model_dir, trials=2)


@pytest.mark.parametrize("env,needle", [
    ({"DRL_PULSE_PLANE": "int8g64"}, "DRL_PULSE_PLANE='int8g64' but run 'wk-run' publishes plane 'bf16'"),
    ({"DRL_N_SAMPLES": "3"}, "DRL_N_SAMPLES=3 but run 'wk-run' requires n_samples=4"),
])
def test_a_worker_process_on_the_wrong_plane_or_group_size_refuses_to_join(tmp_path, tiny_model_dir, env,  # noqa: F811
                                                                          needle):
    store = FileStore(tmp_path / "bucket")
    _publish_run(store, tiny_model_dir)
    p = _spawn(store, tiny_model_dir, env=env)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 3 and needle in err, err
    assert store.list_keys(layout.rollouts_prefix(WRUN)) == []


def test_groups_on_stale_weights_wrong_plane_or_size_are_dropped_with_reasons(tmp_path, tiny_model_dir):  # noqa: F811
    """The worker's own sampling and upload code, after the run moved on (stale weights), and with its
    declared plane or group size changed after the contract check (a worker that does not check)."""
    import torch

    from infra.ops.status import collect_status

    store = FileStore(tmp_path / "bucket")
    man, pub, model = _publish_run(store, tiny_model_dir)
    problem = get_task("arithmetic").dataset("train")[0]
    names = ("ok", "stale", "plane", "size")
    workers = {name: _worker(store, tiny_model_dir, name) for name in names}
    stop = threading.Event()
    for w in workers.values():
        assert w.setup(stop)
    workers["stale"].upload(workers["stale"].sample_group(problem))  # at v1, then it stops following
    learner = _source(store, man)
    learner.poll(3)  # the learner at v3 pools the v1 group (inside its window), but uses other groups first
    for _ in range(5):  # the trainer moves on to v6
        with torch.no_grad():
            for prm in model.parameters():
                prm.add_(0.01 * torch.randn_like(prm))
        pub.publish(model.state_dict())
    for name in ("ok", "plane", "size"):
        workers[name]._swap(*workers[name].rec.follow())
    workers["plane"].plane = "int8g64"
    workers["size"].n_samples = N - 1
    for w in workers.values():
        w.upload(w.sample_group(problem))  # "stale" samples on its v1 weights once more
    learner.poll(6)
    stats = learner.worker_stats()
    assert learner.accepted == 2 and stats["ok"]["groups"] == 1  # ok's group, and stale's v1 group at v3
    # the pooled v1 group aged out of the window unused, and the newer v1 group was found unread by the
    # last listing of v1's prefix when the window left it: both count as stale ...
    assert stats["stale"]["drops"] == {"stale": 2}
    assert stats["plane"]["drops"] == {"wrong_plane": 1}
    assert stats["size"]["drops"] == {"group_size": 1}
    assert learner.metrics()["worker/stale/dropped"] == 2.0
    assert [g.record.worker_id for g in learner.take_batch(6).groups] == ["ok"]
    # ... and the operator sees that worker's lag past the staleness bound (`invoke status`)
    seen = {w.worker_id: w for w in collect_status(store, WRUN, include_bytes=False).workers}
    assert seen["stale"].lag == 5 > man.staleness and seen["ok"].lag == 0


@pytest.mark.soak
def test_soak_worker_kills(tmp_path, moto_server, tiny_model_dir):  # noqa: F811
    trials = max(4, soak_trials(20) // 4)  # a quarter of the crash trials on a file bucket, half that on S3
    store = FileStore(tmp_path / "bucket")
    man, _, _ = _publish_run(store, tiny_model_dir)
    file_figs = kill_mid_upload(store, man, tiny_model_dir, trials=trials, env=None,
                                arm=lambda: _file_uploading(store))
    s3_figs = _s3_kill_run(moto_server, tiny_model_dir, trials=max(2, trials // 2))
    record("worker_kills", {"file": file_figs, "s3": s3_figs, "partial_objects_visible": 0,
                            "tmp_files_left_invisible": len(_tmp_files(store.root))})
