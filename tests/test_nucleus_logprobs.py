"""One meaning of the behaviour log-prob for both workers: the token's log-prob under the distribution it was
drawn from (softmax(logits / T), with top_p < 1 cut to the smallest most-probable prefix whose mass reaches
top_p, the top token always kept, and renormalised). The torch reference sampler and the MLX sampler record
the same value for the same logits at top_p = 0.9; with top_p = 1 the torch sampler records exactly the
temperature-scaled log-softmax and draws exactly the tokens it always drew; greedy decoding ignores top_p.
A run.json with top_p < 1 that another trainer wrote is still followed by both workers (real workers, a file
bucket, a tiny Qwen2 on the CPU), and the learner's source accepts their records."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tests.worker_fixtures import publish_run, save_tiny_qwen2
from worker_contract import layout
from worker_contract.schema import decode_record
from worker_contract.store.file import FileStore
from worker_contract.worker.sampling import _pick, nucleus_logprobs

TOP_P = 0.9


def _logits() -> torch.Tensor:
    """Fixed logits: spread rows, a row whose top token alone holds more than top_p, and a row whose cutoff
    falls inside a run of exactly tied tokens (0.62, then eight at 0.0475: the top token and six of them)."""
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(6, 200, generator=g) * 3
    peaked = torch.zeros(1, 200)
    peaked[0, 17] = 12.0
    tied = torch.full((1, 200), -1e4)
    tied[0, 40] = float(np.log(0.62))
    tied[0, 100:108] = float(np.log(0.0475))
    return torch.cat([spread, peaked, tied])


def _reference(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The definition, in numpy float64: most probable first (ties by lower id), the smallest prefix whose
    mass reaches top_p, renormalised; -inf outside it."""
    z = logits.astype(np.float64) / temperature
    logp = z - np.logaddexp.reduce(z, axis=-1, keepdims=True)
    out = np.full_like(logp, -np.inf)
    for row, lp in enumerate(logp):
        order = np.argsort(-lp, kind="stable")
        p = np.exp(lp[order])
        keep = order[(np.cumsum(p) - p) < top_p]
        out[row, keep] = lp[keep] - np.logaddexp.reduce(lp[keep])
    return out


def _cutoff_margin(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Per row, how far the nearest prefix mass is from top_p: where it is within float error, logits that
    differ by rounding (a cached forward against a full one) may cut the nucleus one token apart."""
    z = logits.astype(np.float64) / temperature
    p = -np.sort(-np.exp(z - np.logaddexp.reduce(z, axis=-1, keepdims=True)), axis=-1)
    return np.abs(np.cumsum(p, axis=-1) - p - top_p).min(axis=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_torch_and_mlx_samplers_record_the_same_logprob_at_top_p_below_1(temperature):
    mx = pytest.importorskip("mlx.core", reason="the MLX sampler needs mlx (mlx[cpu] on Linux)")
    from worker_contract.worker import mlx_sampling

    logits = _logits()
    ours = nucleus_logprobs(logits, temperature, TOP_P).numpy()
    theirs = np.array(mlx_sampling.nucleus_logprobs(mx.array(logits.numpy()), temperature, TOP_P))
    want = _reference(logits.numpy(), temperature, TOP_P)
    for got in (ours, theirs):
        assert np.array_equal(np.isfinite(got), np.isfinite(want))
        np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], atol=1e-5)
    kept = np.flatnonzero(np.isfinite(ours[-1])).tolist()  # the tie rule: the cutoff keeps the lower ids
    assert kept == [40, *range(100, 100 + len(kept) - 1)] and 2 < len(kept) < 9, kept
    if temperature == 1.0:
        assert len(kept) == 7
    assert ours[-2, 17] == 0.0  # a nucleus of one token
    # what the torch sampler records for the tokens it draws is the MLX sampler's value for them
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        tok, lp = _pick(logits, temperature, TOP_P, False, gen)
        assert np.isfinite(theirs[np.arange(len(tok)), tok.numpy()]).all(), "a token outside the nucleus was drawn"
        np.testing.assert_allclose(lp.numpy(), theirs[np.arange(len(tok)), tok.numpy()], atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_p_1_records_the_full_log_softmax_and_draws_the_same_tokens(temperature):
    logits = _logits()
    full = torch.log_softmax(logits.float() / temperature, dim=-1)
    assert torch.equal(nucleus_logprobs(logits, temperature, 1.0), full)
    mine, ref = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(10):
        tok, lp = _pick(logits, temperature, 1.0, False, mine)
        want = torch.multinomial(full.exp(), 1, generator=ref).squeeze(-1)
        assert torch.equal(tok, want) and torch.equal(lp, full.gather(-1, want[:, None]).squeeze(-1))
    for top_p in (1.0, TOP_P):  # greedy (held-out evaluation): the argmax and its full log-prob, top_p aside
        tok, lp = _pick(logits, temperature, top_p, True, None)
        assert torch.equal(tok, full.argmax(-1)) and torch.equal(lp, full.max(-1).values)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny-nucleus"), hidden_size=64, intermediate_size=128)


def _fresh_logits(backend: str, policy, prompt: list[int], response: list[int]) -> np.ndarray:
    """Each response position's logits from one full forward (no cache) of the worker's own model."""
    if backend == "mlx":
        import mlx.core as mx

        out = policy.model(mx.array([prompt + response]))[0].astype(mx.float32)
        return np.array(out)[len(prompt) - 1:-1]
    with torch.no_grad():
        return policy.model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float().numpy()


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_a_top_p_below_1_run_is_followed_by_both_workers(tmp_path, tiny_model_dir, backend):
    """run.json says top_p 0.9 (our recipes refuse it, another trainer may not): each worker samples with it,
    names it in its records, records the nucleus log-probs, and the learner's source drops nothing."""
    if backend == "mlx":
        pytest.importorskip("mlx_lm", reason="the MLX worker needs mlx-lm")
    from trainer.rollouts.pool import BatchRules, RecordRules
    from trainer.rollouts.source import RolloutSource
    from worker_contract.worker.loop import Worker, WorkerSettings

    n, run = 4, "nucleus-run"
    store = FileStore(tmp_path / "bucket")
    cfg, manifest, _, _ = publish_run(store, tiny_model_dir, run, n_samples=n, top_p=TOP_P)
    assert manifest.top_p == TOP_P and cfg.algo.top_p == 1.0
    settings = WorkerSettings(store=store.url, run=run, model_dir=str(tiny_model_dir), worker_id=f"{backend}-1",
                              seed=0, threads=1, backend=backend, max_groups=2)
    w = Worker(settings, env={"DRL_N_SAMPLES": str(n), "DRL_PULSE_PLANE": "bf16"})
    assert w.run(threading.Event()).groups == 2
    src = RolloutSource(store, RecordRules.from_manifest(manifest, cfg.algo),
                        BatchRules(groups_per_step=2, reuse_cap=2))
    assert src.poll(1) == 2 and sum(src.drops.values()) == 0, src.drops
    compared = shifted = 0
    for key in store.list_keys(layout.rollouts_prefix(run)):
        rec = decode_record(store.get(key))
        assert rec.sampling.top_p == TOP_P
        for s in rec.samples:
            logits = _fresh_logits(backend, w.policy, rec.prompt_ids, s.response_ids)
            at = (np.arange(len(s.response_ids)), np.array(s.response_ids))
            want = _reference(logits, manifest.temperature, TOP_P)[at]
            full = _reference(logits, manifest.temperature, 1.0)[at]
            clear = _cutoff_margin(logits, manifest.temperature, TOP_P) > 1e-4
            np.testing.assert_allclose(np.array(s.behavior_logprobs)[clear], want[clear], atol=2e-4)
            compared += int(clear.sum())
            shifted += int((want - full > 1e-3)[clear].sum())
    assert compared > 40 and shifted > 0, (compared, shifted)  # the nucleus cut something: the test checks it
