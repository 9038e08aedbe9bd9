"""psqa search episodes on both workers (torch and MLX on the CPU), tiny LFM2 / LFM2-MoE over a 16-word
tokenizer: masks and tool turns as the task says, every sampled log-prob equal to a cache-free recomputation
by both engines (so the extended caches are right), the prefill counted both ways and equal to the tokens
that went through the model, and a turn ending at `</search>`, `</answer>` or EOS and nowhere else."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.episode_fixtures import WORDS, save_search_model
from worker_contract.planes import get_plane
from worker_contract.tasks.psqa import tool_turn_text

mx = pytest.importorskip("mlx.core", reason="the MLX worker needs mlx (mlx[cpu] on Linux)")
pytest.importorskip("mlx_lm", reason="the MLX worker needs mlx-lm")

T = 1.0
N = 8
BUDGET = 64
DOCS = "Doc 1 the dmd gene is a protein kinase"


def search(query: str) -> str:
    return DOCS  # the tool's output; the real retriever is exercised in test_worker_psqa.py


def _load_both(d):
    from transformers import AutoModelForCausalLM

    from worker_contract.worker.mlx_model import MlxPolicy
    from worker_contract.worker.model import PolicyModel

    hf = AutoModelForCausalLM.from_pretrained(d)
    state = get_plane("bf16").from_hf({k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"})
    tp = PolicyModel(d, threads=1, seed=1, device="cpu")
    tp.load_plane("bf16", state)
    mp = MlxPolicy(d, plane="bf16", seed=1, dtype="float32")
    mp.load_plane("bf16", state)
    return tp, mp


@pytest.fixture(scope="module", params=["lfm2", "lfm2_moe"])
def policies(request, tmp_path_factory):
    return _load_both(save_search_model(tmp_path_factory.mktemp(request.param), request.param))


class _MlxCounting:
    """The MLX model with the tokens of every forward counted (what the engine calls is the model itself)."""

    def __init__(self, inner):
        self.inner, self.fed = inner, 0

    def __call__(self, x, cache=None):
        self.fed += int(x.size)
        return self.inner(x, cache=cache)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _sample_counting_forwards(policy, prompt, **kw):
    """policy.sample_episodes with the tokens through the model's forward counted: (episodes, counts, fed)."""
    if hasattr(policy, "generator"):  # torch: every forward starts at the input embedding
        fed = [0]
        hook = policy.model.get_input_embeddings().register_forward_pre_hook(
            lambda _m, args: fed.__setitem__(0, fed[0] + args[0].numel()))
        try:
            eps, count = policy.sample_episodes(prompt, N, **kw)
        finally:
            hook.remove()
        return eps, count, fed[0]
    inner = policy.model
    policy.model = _MlxCounting(inner)
    try:
        eps, count = policy.sample_episodes(prompt, N, **kw)
        return eps, count, policy.model.fed
    finally:
        policy.model = inner


def _torch_fresh(tp, prompt, response, temp=T):
    with torch.no_grad():
        logits = tp.model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temp, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()


def _mlx_fresh(mp, prompt, response, temp=T):
    logits = mp.model(mx.array([prompt + response]))[0, len(prompt) - 1:-1].astype(mx.float32) / temp
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(mx.take_along_axis(logp, mx.array(response)[:, None], axis=-1)[:, 0])


def _groups_with_a_search(policy, prompt, temp=T):
    """Groups of N episodes until one searched (the same ones every run: seeded policies)."""
    out = []
    for _ in range(8):
        eps, count, fed = _sample_counting_forwards(policy, prompt, temperature=temp, top_p=1.0, max_new_tokens=BUDGET,
                                                    search=search)
        # the model saw the prompt once, each extension once, and each sampled token but a turn's last once:
        # no sample's context was fed again from the start
        assert fed == count.extend + sum(sum(e.loss_mask) for e in eps) - count.turns, (fed, count)
        out.append((eps, count))
        if sum(len(e.searches) for e in eps) >= 2:
            break
    assert any(e.searches for eps, _ in out for e in eps), "no episode searched in 8 groups"
    return out


def _segments(mask):
    """(start, end, mask value) runs of a loss mask."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs


@pytest.mark.parametrize("temp", [T, 0.7])
@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_episodes_masks_logprobs_and_prefill(policies, backend, temp):
    tp, mp = policies
    policy = tp if backend == "torch" else mp
    prompt = tp.prompt_ids([{"role": "user", "content": "Question: the dmd gene is"}])
    assert prompt == mp.prompt_ids([{"role": "user", "content": "Question: the dmd gene is"}])
    tool_ids = tp.encode(tool_turn_text(DOCS))
    worst = {"torch": 0.0, "mlx": 0.0}
    for eps, count in _groups_with_a_search(policy, prompt, temp):
        extensions = 0
        for e in eps:
            n = len(e.response_ids)
            assert n <= BUDGET and len(e.loss_mask) == len(e.behavior_logprobs) == n
            runs = _segments(e.loss_mask)
            tools = [(a, b) for a, b, m in runs if m == 0]
            # one tool turn per search, nothing else unmasked; the last search may find the budget spent
            # or the turns used up
            assert len(tools) == len(e.searches) or (
                len(tools) == len(e.searches) - 1 and e.finish_reason in ("length", "tool"))
            for a, b in tools:
                assert e.response_ids[a:b] == tool_ids[:b - a] and set(e.behavior_logprobs[a:b]) == {0.0}
                extensions += (b - a + 1) if b < n else 0  # the last sampled token and the tool turn
            sampled = np.array(e.loss_mask, dtype=bool)
            lp = np.array(e.behavior_logprobs)[sampled]
            for name, fresh in (("torch", _torch_fresh(tp, prompt, e.response_ids, temp)),
                                ("mlx", _mlx_fresh(mp, prompt, e.response_ids, temp))):
                worst[name] = max(worst[name], float(np.abs(fresh[sampled] - lp).max()))
        assert count.extend == len(prompt) + extensions
        # re-prefilling from the start: each sample's prompt, then its whole context before every later turn
        assert count.reprefill == sum(len(prompt) + sum(len(prompt) + b for _, b, m in _segments(e.loss_mask)
                                                        if m == 0 and b < len(e.response_ids)) for e in eps)
        if any(e.searches for e in eps):
            assert count.extend < count.reprefill
    print(f"{backend}-sampled episodes: max |behaviour - recomputed| torch {worst['torch']:.2e}, mlx {worst['mlx']:.2e}")
    assert worst["torch"] < 1e-4 and worst["mlx"] < 1e-4, worst


ANSWER_WORDS = [*WORDS, "<answer>", "</answer>"]


@pytest.fixture(scope="module")
def answering(tmp_path_factory):
    return _load_both(save_search_model(tmp_path_factory.mktemp("answering"), "lfm2_moe", words=ANSWER_WORDS))


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_a_turn_ends_at_search_answer_or_eos_and_nowhere_else(answering, backend):
    """With `<answer>` tags in the vocabulary: every sampled turn ends at `</search>` (a tool turn follows,
    or the turns or the budget ran out), at `</answer>` or EOS (the episode is done), or where the budget
    ends; none of the three appears inside a turn."""
    tp, mp = answering
    policy = tp if backend == "torch" else mp
    prompt = tp.prompt_ids([{"role": "user", "content": "Question: the dmd gene is"}])
    eos, search_close, answer_close = 0, ANSWER_WORDS.index("</search>"), ANSWER_WORDS.index("</answer>")
    stops = {eos, search_close, answer_close}
    ends = {"search": 0, "answer": 0, "eos": 0}
    for _ in range(12):
        eps, _ = policy.sample_episodes(prompt, N, temperature=T, top_p=1.0, max_new_tokens=BUDGET, search=search)
        for e in eps:
            n = len(e.response_ids)
            turns = [(a, b) for a, b, m in _segments(e.loss_mask) if m == 1]
            for i, (a, b) in enumerate(turns):
                ids = e.response_ids[a:b]
                assert not stops & set(ids[:-1]), (ids, e.text)
                last_turn = i == len(turns) - 1 and (b == n or e.loss_mask[b:] == [0] * (n - b))
                if not last_turn:
                    assert ids[-1] == search_close, (ids, e.text)
                    ends["search"] += 1
                elif ids[-1] in (eos, answer_close):
                    assert e.finish_reason == "stop", e.finish_reason
                    ends["answer" if ids[-1] == answer_close else "eos"] += 1
                elif ids[-1] == search_close:
                    assert e.finish_reason in ("tool", "length"), e.finish_reason
                else:
                    assert n == BUDGET and e.finish_reason == "length", (n, e.finish_reason)
        if ends["answer"] >= 2 and ends["search"] >= 2:
            break
    assert ends["answer"] >= 2 and ends["search"] >= 2 and ends["eos"] >= 1, ends
