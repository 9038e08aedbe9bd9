"""A group's search episodes decode together (worker/episodes.py) on both workers, the next turn's tool
turns fed in one ragged forward: the same tokens and log-probs as decoding one sample at a time under the same
seed (each sample draws from its own stream; MLX bit for bit, torch to float32 rounding, since a batched
matmul sums in another order), far fewer forward passes, several groups in one batch, and a sample's tool
turn holding only its own tokens (every log-prob equal to a cache-free recomputation of that sample's own
context, with each search answered differently)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.episode_fixtures import reseed, save_search_model, varied_search
from tests.test_psqa_episodes import _load_both, _mlx_fresh, _torch_fresh

mx = pytest.importorskip("mlx.core", reason="the MLX worker needs mlx (mlx[cpu] on Linux)")
pytest.importorskip("mlx_lm", reason="the MLX worker needs mlx-lm")

N, BUDGET = 8, 48
QUESTION = [{"role": "user", "content": "Question: the dmd gene is"}]
OTHER = [{"role": "user", "content": "Question: a protein kinase in the cell"}]


@pytest.fixture(scope="module", params=["lfm2", "lfm2_moe"])
def policies(request, tmp_path_factory):
    return _load_both(save_search_model(tmp_path_factory.mktemp(request.param), request.param, seed=3))


def _groups(policy, prompts, *, batched, seed, temp, top_p):
    reseed(policy, seed)
    return policy.sample_episode_groups(prompts, N, temperature=temp, top_p=top_p, max_new_tokens=BUDGET,
                                        search=varied_search(), batched=batched)


@pytest.mark.parametrize("temp,top_p", [(1.0, 1.0), (0.7, 0.9)])
@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_batched_episodes_equal_one_sample_at_a_time(request, policies, backend, temp, top_p):
    tp, mp = policies
    policy = tp if backend == "torch" else mp
    moe = request.node.callspec.params["policies"] == "lfm2_moe"
    assert (policy.recorder is not None) == moe, "routes recorded for the MoE model only"
    prompts = [policy.prompt_ids(QUESTION), policy.prompt_ids(OTHER)]
    searched, fed_alone, fed_together = 0, 0, 0
    for seed in range(8):  # until tool turns happened, two rows' together at least once (two seeds at least)
        if seed >= 2 and searched >= 2 and fed_together < fed_alone:
            break
        one, c1 = _groups(policy, prompts, batched=False, seed=seed, temp=temp, top_p=top_p)
        many, cn = _groups(policy, prompts, batched=True, seed=seed, temp=temp, top_p=top_p)
        for g1, gn in zip(one, many, strict=True):
            for a, b in zip(g1, gn, strict=True):
                assert a.response_ids == b.response_ids and a.loss_mask == b.loss_mask
                assert a.finish_reason == b.finish_reason and a.searches == b.searches
                if moe:  # the same routes either way (tests/test_routing_replay.py: they are the forward's)
                    assert np.array_equal(a.routes, b.routes) and np.array_equal(a.prompt_routes, b.prompt_routes)
                else:  # a dense model records nothing
                    assert a.routes is b.routes is a.prompt_routes is b.prompt_routes is None
                diff = np.abs(np.array(a.behavior_logprobs) - np.array(b.behavior_logprobs)).max()
                assert diff == 0.0 if backend == "mlx" else diff < 1e-5, diff
                searched += len(b.searches)
        assert (c1.extend, c1.reprefill, c1.turns) == (cn.extend, cn.reprefill, cn.turns)
        sampled = sum(sum(e.loss_mask) for g in many for e in g)
        # one at a time: a forward per sampled token but each turn's last, plus prefills; together: fewer
        assert cn.forwards < c1.forwards <= sampled + c1.extend, (cn.forwards, c1.forwards, sampled)
        assert cn.extensions <= c1.extensions, (cn.extensions, c1.extensions)
        fed_alone, fed_together = fed_alone + c1.extensions, fed_together + cn.extensions
    assert searched >= 2, "no tool turn happened: the test would not cover rejoining"
    # the tool turns of a turn's rows are fed in one ragged forward (the tiny feeds fit one chunk), not a row each
    assert fed_together < fed_alone, (fed_together, fed_alone)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_a_tool_turn_holds_only_its_own_samples_tokens(policies, backend):
    tp, mp = policies
    policy = tp if backend == "torch" else mp
    prompt = policy.prompt_ids(QUESTION)
    worst, searched = 0.0, 0
    for seed in range(4):
        (eps,), _ = _groups(policy, [prompt], batched=True, seed=seed, temp=1.0, top_p=1.0)
        for e in eps:
            searched += len(e.searches)
            sampled = np.array(e.loss_mask, dtype=bool)
            fresh = (_torch_fresh if backend == "torch" else _mlx_fresh)(tp if backend == "torch" else mp,
                                                                          prompt, e.response_ids, 1.0)
            worst = max(worst, float(np.abs(fresh[sampled] - np.array(e.behavior_logprobs)[sampled]).max()))
    assert searched >= 2, "no tool turn happened"
    assert worst < 1e-4, worst


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_a_ragged_extension_equals_a_prefill_a_row(policies, backend, monkeypatch):
    """`Engine.extend` against each row's own prefill: rows of different histories fed 3, 17 and 30 tokens (MLX in
    chunks of 8 positions a row, so rows end in different chunks): the same last logits, and the caches it leaves
    give the same next step (attention rolled to the left, each conv state cut at its row's end)."""
    from worker_contract.worker import mlx_sampling

    tp, mp = policies
    policy = tp if backend == "torch" else mp
    monkeypatch.setattr(mlx_sampling, "PREFILL_CHUNK", 24)  # 3 rows: 8 positions a row a chunk
    eng = policy.episode_engine(temperature=1.0, top_p=1.0)
    rng = np.random.default_rng(0)
    prompt = policy.prompt_ids(QUESTION)
    histories = [prompt, prompt + [5, 6, 7, 8, 9], prompt + [11] * 12]
    feeds = [[int(t) for t in rng.integers(3, 15, size=k)] for k in (3, 17, 30)]

    def fresh(ids):
        state, _ = eng.prefill(ids, None)
        return state

    as_array = (lambda t: t.float().numpy()) if backend == "torch" else (lambda t: np.array(t))
    alone = [eng.prefill(f, fresh(h)) for h, f in zip(histories, feeds, strict=True)]
    batch, logits = eng.extend([fresh(h) for h in histories], feeds)
    want, _ = eng.merge([s for s, _ in alone], [lg for _, lg in alone])
    np.testing.assert_allclose(as_array(logits), np.concatenate([as_array(lg) for _, lg in alone]), atol=1e-4)
    step = [4, 9, 13]
    np.testing.assert_allclose(as_array(eng.forward(batch, step)), as_array(eng.forward(want, step)), atol=1e-4)
