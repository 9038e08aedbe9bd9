"""The reference worker against a file bucket with a tiny model: valid records, log-probs equal to a fresh
forward of the published weights, weights swapped only between groups, fail-closed contract checks with
messages naming the differing value, and a graceful SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.worker_fixtures import publish_run, save_tiny_qwen2
from worker_contract import layout
from worker_contract.manifest import ContractMismatch
from worker_contract.schema import decode_record
from worker_contract.store.file import FileStore
from worker_contract.tasks import get_task

REPO = Path(__file__).resolve().parent.parent
RUN = "wk-run"
N = 4


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 1-layer Qwen2 with a tokenizer trained on generated problems (seconds to build)."""
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny"), hidden_size=32, intermediate_size=64)


def _publish_run(store, model_dir, *, n_samples=N, max_new_tokens=12):
    """(manifest, publisher, model) of the run `RUN`, published in `store`."""
    return publish_run(store, model_dir, RUN, n_samples=n_samples, max_new_tokens=max_new_tokens)[1:]


@pytest.fixture
def run_store(tmp_path, tiny_model_dir):
    store = FileStore(tmp_path / "bucket")
    manifest, pub, model = _publish_run(store, tiny_model_dir)
    return store, manifest, pub, model


def _worker(store, model_dir, env=None, **over):
    from worker_contract.worker.loop import Worker, WorkerSettings

    settings = WorkerSettings(store=store.url, run=RUN, model_dir=str(model_dir), worker_id="w1", seed=0,
                              threads=1, **over)
    return Worker(settings, env={"DRL_N_SAMPLES": str(N), "DRL_PULSE_PLANE": "bf16", **(env or {})})


def _fresh_logprobs(model_dir, state, prompt, response, temperature):
    """Log-probs of `response` after `prompt` from one full forward of the published weights."""
    from worker_contract.planes import get_plane
    from worker_contract.worker.model import PolicyModel

    pm = PolicyModel(model_dir, threads=1)
    pm.load(get_plane("bf16").to_dense(state))
    ids = torch.tensor([prompt + response])
    logits = pm.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _records(store, version=None):
    prefix = layout.rollout_version_prefix(RUN, version) if version else layout.rollouts_prefix(RUN)
    return [(k, decode_record(store.get(k))) for k in store.list_keys(prefix)]


def test_worker_uploads_valid_records_whose_logprobs_match_a_fresh_forward(run_store, tiny_model_dir):
    from worker_contract.reconstruct import Reconstructor

    store, manifest, _, _ = run_store
    stats = _worker(store, tiny_model_dir, max_groups=3).run(threading.Event())
    assert stats.groups == 3
    recs = _records(store)
    assert len(recs) == 3
    _, state = Reconstructor(store, RUN, plane="bf16").join()
    task = get_task("arithmetic")
    tok_vocab = manifest.vocab_size
    for key, rec in recs:
        assert layout.parse_rollout_key(key).version == rec.policy_version == 1
        assert rec.worker_id == "w1" and rec.task == "arithmetic" and len(rec.samples) == N
        assert rec.sampling.temperature == manifest.temperature
        assert rec.sampling.max_new_tokens == manifest.max_new_tokens
        problem = next(p for p in [task.dataset("train")[int(rec.prompt_id.rsplit("-", 1)[1])]])
        assert problem.id == rec.prompt_id
        for s in rec.samples:
            assert 0 < len(s.response_ids) <= manifest.max_new_tokens
            assert all(0 <= t < tok_vocab for t in s.response_ids)
            assert s.reward in (0.0, 1.0) and s.loss_mask == [1] * len(s.response_ids)
            fresh = _fresh_logprobs(tiny_model_dir, state, rec.prompt_ids, s.response_ids, manifest.temperature)
            assert torch.allclose(torch.tensor(s.behavior_logprobs), fresh, atol=1e-4), (s.behavior_logprobs, fresh)


def test_worker_swaps_weights_only_between_groups(run_store, tiny_model_dir):
    store, manifest, pub, model = run_store
    w = _worker(store, tiny_model_dir, max_groups=1)
    stop = threading.Event()
    assert w.setup(stop)
    w.loop(stop)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert pub.publish(model.state_dict()).version == 2
    # a group sampled now still belongs to the version the worker holds
    problem = get_task("arithmetic").dataset("train")[0]
    assert w.sample_group(problem).policy_version == 1
    w.s = w.s.model_copy(update={"max_groups": 2})
    w.loop(stop)
    assert w.stats.versions_seen == [1, 2]
    (_, rec2), = _records(store, 2)
    from worker_contract.reconstruct import Reconstructor

    _, state2 = Reconstructor(store, RUN, plane="bf16").join()
    s = rec2.samples[0]
    fresh = _fresh_logprobs(tiny_model_dir, state2, rec2.prompt_ids, s.response_ids, manifest.temperature)
    assert torch.allclose(torch.tensor(s.behavior_logprobs), fresh, atol=1e-4)


@pytest.mark.parametrize("env,needle", [
    ({"DRL_N_SAMPLES": "8"}, "DRL_N_SAMPLES=8 but run 'wk-run' requires n_samples=4"),
    ({"DRL_PULSE_PLANE": "int8g64"}, "DRL_PULSE_PLANE='int8g64' but run 'wk-run' publishes plane 'bf16'"),
])
def test_worker_fails_closed_on_group_size_or_plane(run_store, tiny_model_dir, env, needle):
    store = run_store[0]
    with pytest.raises(ContractMismatch) as e:
        _worker(store, tiny_model_dir, env=env).setup(threading.Event())
    assert needle in str(e.value)
    assert _records(store) == []


def test_worker_fails_closed_on_another_model(run_store, tiny_model_dir, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages[0]['content'] }}"
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    (other / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ContractMismatch, match="chat_template_digest: local model has 'sha256:"):
        _worker(run_store[0], other).setup(threading.Event())


def test_worker_refuses_an_unknown_contract_version(tmp_path, tiny_model_dir):
    store = FileStore(tmp_path / "b2")
    store.put(layout.manifest_key(RUN), json.dumps({"contract_version": 2, "run": RUN}).encode())
    with pytest.raises(ContractMismatch, match="contract_version=2; this worker speaks contract_version=1"):
        _worker(store, tiny_model_dir).setup(threading.Event())


def test_a_light_tier_worker_joining_a_psqa_run_without_a_retriever_is_refused(tmp_path, tiny_model_dir):
    store = FileStore(tmp_path / "b3")
    manifest, _, _ = _publish_run(store, tiny_model_dir)
    store.put(layout.manifest_key(RUN), manifest.model_copy(update={"task": "psqa"}).to_bytes())
    with pytest.raises(ValueError, match="light-tier worker cannot hold the search index: set DRL_RETRIEVER_URL"):
        _worker(store, tiny_model_dir, retriever_tier="light").setup(threading.Event())
    with pytest.raises(ValueError, match="needs a retriever: set DRL_RETRIEVER_URL .* on this medium-tier"):
        _worker(store, tiny_model_dir, retriever_tier="medium").setup(threading.Event())
    store.put(layout.manifest_key(RUN), manifest.model_copy(update={"task": "chess"}).to_bytes())
    with pytest.raises(ContractMismatch, match="trains task 'chess'; this worker samples arithmetic, gsm8k, psqa"):
        _worker(store, tiny_model_dir).setup(threading.Event())


def test_worker_identity_digests_agree_with_the_trainers(tiny_model_dir):
    from trainer.models.identity import identity_from_hf
    from worker_contract.worker.identity import local_identity

    assert local_identity(tiny_model_dir) == identity_from_hf(tiny_model_dir).manifest_values()


def _spawn(store, model_dir, *extra, env=None):
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "DRL_N_SAMPLES": str(N), "DRL_PULSE_PLANE": "bf16",
                **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "worker_contract.worker", "--store", store.url, "--run", RUN, "--model",
         str(model_dir), "--worker-id", "proc", "--threads", "1", "--log-every", "1", *extra],
        env=full_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_worker_process_exits_3_with_the_differing_value(run_store, tiny_model_dir):
    p = _spawn(run_store[0], tiny_model_dir, env={"DRL_N_SAMPLES": "16"})
    out, err = p.communicate(timeout=120)
    assert p.returncode == 3, err
    assert "worker refuses to join: DRL_N_SAMPLES=16 but run 'wk-run' requires n_samples=4" in err


def test_a_worker_without_torch_says_to_run_the_mlx_backend(run_store, tiny_model_dir, tmp_path):
    """A Mac installed with the mlx extra alone, started without --backend mlx: a traceback and 'a bug' (exit 70)."""
    hide = tmp_path / "no-torch"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n\n\nclass Hide:\n    @staticmethod\n    def find_spec(name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n\n\n"
        "sys.meta_path.insert(0, Hide)\n")
    p = _spawn(run_store[0], tiny_model_dir, env={"PYTHONPATH": f"{hide}:{REPO}"})
    _, err = p.communicate(timeout=120)
    assert p.returncode == 3 and "Traceback" not in err, err
    assert "the torch worker needs torch and transformers" in err and "pass --backend mlx" in err, err


def test_sigterm_finishes_the_group_in_hand_and_leaves_only_whole_records(run_store, tiny_model_dir):
    store = run_store[0]
    p = _spawn(store, tiny_model_dir)
    try:
        deadline = time.monotonic() + 120
        while not store.list_keys(layout.rollouts_prefix(RUN)):
            assert p.poll() is None, p.communicate()[1]
            assert time.monotonic() < deadline, "no record within 120 s"
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert "finishing the group in hand" in err and "groups uploaded" in err
    recs = _records(store)
    assert recs and all(len(r.samples) == N for _, r in recs)
    leftovers = [q for q in Path(store.root).rglob("*") if q.name.startswith(".tmp-")]
    assert leftovers == []


def test_waiting_on_an_empty_file_store_says_it_is_empty(tmp_path, tiny_model_dir):
    """A typo in --store opened (and so made) an empty directory, and the worker waited without a word on it."""
    store = FileStore(tmp_path / "buckt")
    p = _spawn(store, tiny_model_dir, "--wait", "1")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "(it is empty: if the trainer already runs, check --store / DRL_STORE)" in err, err
