"""A group's search episodes decode together (worker/episodes.py) on both workers: the same tokens and
log-probs as decoding one sample at a time under the same seed (each sample draws from its own stream; MLX
bit for bit, torch to float32 rounding, since a batched matmul sums in another order), far fewer forward
passes, several groups in one batch, and a sample's tool turn holding only its own tokens (every log-prob
equal to a cache-free recomputation of that sample's own context, with each search answered differently)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.episode_fixtures import save_search_model
from tests.test_psqa_episodes import _load_both, _mlx_fresh, _torch_fresh

mx = pytest.importorskip("mlx.core", reason="the MLX worker needs mlx (mlx[cpu] on Linux)")
pytest.importorskip("mlx_lm", reason="the MLX worker needs mlx-lm")

N, BUDGET = 8, 48
QUESTION = [{"role": "user", "content": "Question: the dmd gene is"}]
OTHER = [{"role": "user", "content": "Question: a protein kinase in the cell"}]


@pytest.fixture(scope="module", params=["lfm2", "lfm2_moe"])
def policies(request, tmp_path_factory):
    return _load_both(save_search_model(tmp_path_factory.mktemp(request.param), request.param, seed=3))


def _reseed(policy, seed: int) -> None:
    if hasattr(policy, "generator"):
        policy.generator.manual_seed(seed)
    else:
        policy.key = mx.random.key(seed)


def _docs():
    """A search tool whose every answer differs (so one sample's tool turn cannot pass for another's)."""
    words = itertools.cycle(["dmd gene", "protein kinase", "the cell", "a gene of the cell", "kinase in a cell"])
    return lambda query: f"Doc 1 {next(words)} is {next(words)}"


def _groups(policy, prompts, *, batched, seed, temp, top_p):
    _reseed(policy, seed)
    return policy.sample_episode_groups(prompts, N, temperature=temp, top_p=top_p, max_new_tokens=BUDGET,
                                        search=_docs(), batched=batched)


@pytest.mark.parametrize("temp,top_p", [(1.0, 1.0), (0.7, 0.9)])
@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_batched_episodes_equal_one_sample_at_a_time(request, policies, backend, temp, top_p):
    tp, mp = policies
    policy = tp if backend == "torch" else mp
    moe = request.node.callspec.params["policies"] == "lfm2_moe"
    assert (policy.recorder is not None) == moe, "routes recorded for the MoE model only"
    prompts = [policy.prompt_ids(QUESTION), policy.prompt_ids(OTHER)]
    searched = 0
    for seed in range(4):  # until tool turns happened (two seeds at least)
        if seed >= 2 and searched >= 2:
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
    assert searched >= 2, "no tool turn happened: the test would not cover rejoining"


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
