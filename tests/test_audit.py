"""The worker audit: recorded behaviour log-probs against the learner's recomputation at the same version.

Honest workers (log-probs from the published bf16 weights) stay unflagged; a worker that shifts its
log-probs, or samples with other weights while claiming the version, is flagged. Once on the audit object
directly with the real hf backend, once through the whole learner loop on Ray, where workers follow the
pointer through the real reconstructor and the flags must reach metrics.jsonl and the bucket's stats.
"""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest
import torch
from learner_fixtures import make_record, manifest, put_record, recipe, save_tiny_model, tiny_model

from trainer.backends import get_backend
from trainer.rollouts.audit import DEFAULT_THRESHOLD, WorkerAudit
from trainer.step import collate
from worker_contract.schema import RolloutRecord, Sample

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def bf16_copy(model):
    """The model as a bf16-plane worker runs it: weights rounded to bf16 (then computed in fp32)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def tamper(rec: RolloutRecord, shift: float) -> RolloutRecord:
    """The same group with every trained-on log-prob moved by `shift` nats (kept <= 0)."""
    samples = [Sample(**{**s.model_dump(), "behavior_logprobs": [min(0.0, b - shift) if m else b for b, m in
                                                                 zip(s.behavior_logprobs, s.loss_mask, strict=True)]})
               for s in rec.samples]
    return rec.model_copy(update={"samples": samples})


def test_honest_worker_passes_tampering_and_wrong_weights_are_flagged(model_dir):
    backend = get_backend("hf").load(model_dir, recipe(), device="cpu")
    honest_model, other_model = bf16_copy(tiny_model(seed=0)), tiny_model(seed=1)
    with torch.no_grad():  # random tiny models are near uniform; sharpen the other one so it differs like real ones
        other_model.model.embed_tokens.weight.mul_(5)
    audit = WorkerAudit(max_groups=3)
    rng = random.Random(0)
    logprobs = lambda recs: backend.logprobs(collate(recs))  # noqa: E731
    for i in range(12):
        recs = [make_record("r", 5, "honest", f"h{i}", rng, model=honest_model),
                tamper(make_record("r", 5, "tamper", f"t{i}", rng, model=honest_model), 0.7),
                make_record("r", 5, "wrongw", f"o{i}", rng, model=other_model),
                make_record("r", 4, "old", f"x{i}", rng, model=honest_model)]  # another version: not audited
        assert audit.audit_step(recs, 5, logprobs) == 3
        assert audit.audit_step(recs, None, logprobs) == 0  # weights not published: nothing to compare
    stats = audit.stats()
    assert set(stats) == {"honest", "tamper", "wrongw"}
    assert stats["honest"]["logprob_mismatch"] < 0.02 and not stats["honest"]["flagged"]
    assert stats["tamper"]["logprob_mismatch"] > 0.5 and stats["tamper"]["flagged"]
    assert stats["wrongw"]["logprob_mismatch"] > DEFAULT_THRESHOLD and stats["wrongw"]["flagged"]
    assert stats["honest"]["audited_version"] == 5  # the version it was measured at ("old"'s 4 never was)
    m = audit.metrics()
    assert m["worker/honest/flagged"] == 0.0 and m["worker/tamper/flagged"] == 1.0
    assert m["audit/flagged_workers"] == 2.0 and m["worker/honest/audited_tokens"] >= 64
    merged = audit.merge_into({"honest": {"groups": 9}, "idle": {"groups": 1}})
    assert merged["honest"]["groups"] == 9 and merged["honest"]["flagged"] is False and "flagged" not in merged["idle"]


def test_a_worker_is_not_flagged_before_min_tokens_and_recovers_after_its_window(model_dir):
    backend = get_backend("hf").load(model_dir, recipe(), device="cpu")
    model = bf16_copy(tiny_model(seed=0))
    audit = WorkerAudit(max_groups=1, min_tokens=40, window=4)
    rng = random.Random(1)
    logprobs = lambda recs: backend.logprobs(collate(recs))  # noqa: E731
    audit.audit_step([tamper(make_record("r", 2, "w", "g0", rng, model=model), 1.0)], 2, logprobs)
    assert audit.stats()["w"]["logprob_mismatch"] > 0.5 and not audit.flagged("w")  # too few tokens to judge
    for i in range(1, 5):
        audit.audit_step([tamper(make_record("r", 2, "w", f"g{i}", rng, model=model), 1.0)], 2, logprobs)
    assert audit.flagged("w")
    for i in range(5, 9):  # it mends its ways: the window forgets the edited groups
        audit.audit_step([make_record("r", 2, "w", f"g{i}", rng, model=model)], 2, logprobs)
    assert not audit.flagged("w")
    with pytest.raises(ValueError, match="threshold"):
        WorkerAudit(threshold=-1)


def _dense_into(model, state: dict[str, np.ndarray]) -> None:
    """Load a reconstructed plane state (HF names; the tied lm_head is published once) into a model."""
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, arr in state.items():
            params[name].copy_(torch.from_numpy(np.asarray(arr, dtype=np.float32)))


class FollowingWorkers(threading.Thread):
    """Two workers that follow the pointer through the real reconstructor and upload one group per version
    each: one honest, one that shifts its log-probs."""

    def __init__(self, store, run: str):
        super().__init__(daemon=True)
        self.store, self.run_id = store, run
        self.stop = threading.Event()  # also set on a failure, which stops the learner too
        self.versions: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        from worker_contract import layout
        from worker_contract.planes import get_plane
        from worker_contract.reconstruct import Reconstructor

        try:
            rec = Reconstructor(self.store, self.run_id, plane="bf16")
            model, rng = tiny_model(seed=0), random.Random(2)
            while not self.stop.wait(0.05):
                if rec.state is None and not self.store.exists(layout.pointer_key(self.run_id)):
                    continue  # nothing published yet
                got = rec.follow()  # joins first when it holds nothing
                if not got:
                    continue
                version, state = got
                _dense_into(model, get_plane("bf16").to_dense(state))
                put_record(self.store, make_record(self.run_id, version, "honest", f"h{version}", rng, model=model))
                put_record(self.store, tamper(make_record(self.run_id, version, "tamper", f"t{version}", rng,
                                                          model=model), 0.7))
                self.versions.append(version)
        except BaseException as e:  # surfaced by the test
            self.error = e
            self.stop.set()


@pytest.mark.integration
def test_learner_flags_a_tampering_worker_in_metrics_and_bucket_stats(model_dir, tmp_path):
    from trainer.metrics import read_metrics
    from trainer.native.learner import run_learner
    from worker_contract import layout
    from worker_contract.manifest import create_or_resume
    from worker_contract.pointer import read_pointer
    from worker_contract.signing import generate_private_key
    from worker_contract.store.file import FileStore

    store = FileStore(tmp_path / "bucket")
    key = generate_private_key()
    man = create_or_resume(store, manifest("audit", key), resume=False)
    cfg = recipe(num_steps=12, save_interval=100)
    cfg.algo.reuse_cap = 1  # each step waits for the groups sampled at the version it just published
    workers = FollowingWorkers(store, "audit")
    workers.start()
    watchdog = threading.Timer(300, workers.stop.set)  # a stuck loop fails the test instead of hanging it
    watchdog.start()
    try:
        result = run_learner(cfg, store, man, key, model_dir, tmp_path / "run", stop_event=workers.stop,
                             batch_wait_s=0.5, torch_threads=1)
    finally:
        watchdog.cancel()
        workers.stop.set()
        workers.join(timeout=30)
    assert result.step == 12, f"stopped at step {result.step}"
    assert workers.error is None, workers.error
    last = read_metrics(tmp_path / "run")[-1]
    assert last["worker/tamper/flagged"] == 1.0 and last["worker/tamper/logprob_mismatch"] > 0.5
    assert last["worker/honest/flagged"] == 0.0 and last["worker/honest/logprob_mismatch"] < 0.05
    assert last["worker/honest/audited_tokens"] >= 64
    pointer, _ = read_pointer(store, "audit", man.trainer_public_key)
    stats = json.loads(store.get(layout.stats_key("audit", pointer.version)))
    assert stats["workers"]["tamper"]["flagged"] is True and stats["workers"]["honest"]["flagged"] is False

    # the operator's view (`invoke status`) reads the bucket alone and shows it
    from rich.console import Console

    from infra.ops.status import collect_status
    from infra.ops.status_view import render_status

    st = collect_status(store, "audit", include_bytes=False)
    seen = {w.worker_id: w for w in st.workers}
    assert seen["tamper"].flagged is True and seen["tamper"].logprob_mismatch > 0.5
    assert seen["honest"].flagged is False and seen["honest"].logprob_mismatch < 0.05
    console = Console(record=True, width=200)
    console.print(render_status(st))
    text = console.export_text()
    row = {line.strip("│ ").split(" ")[0]: line for line in text.splitlines() if line.startswith("│")}
    assert "FLAGGED" in row["tamper"] and "FLAGGED" not in row["honest"], text
    # with the version it was measured at: a learner that never waits audits its first step only
    assert seen["honest"].audited_version is not None and f"@v{seen['honest'].audited_version}" in row["honest"]
