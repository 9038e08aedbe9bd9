"""MoE routing replay end to end on the CPU: the torch and MLX workers record the routes their forwards
took (single-turn groups; psqa episodes with tool turns, several groups decoding in one batch), equal to
the routes of one forward of the same tokens on the same weights, token for token and layer for layer;
records carry them (version 2) and the learner's rules accept them; the hf backend's replayed forward
equals its normal forward where the routes agree and differs where they do not, and the router still gets
a gradient; hf and megatron replay alike."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tests.episode_fixtures import save_search_model
from worker_contract.planes import get_plane
from worker_contract.routes import (
    RouteShape,
    decode_routes,
    encode_routes,
    route_shape,
    routed_response_tokens,
)

mx = pytest.importorskip("mlx.core", reason="the MLX worker needs mlx (mlx[cpu] on Linux)")

N = 4
BUDGET = 24
DOCS = "Doc 1 the dmd gene is a protein kinase"


def search(query: str) -> str:
    return DOCS


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """The tiny LFM2-MoE with weights exact in bf16: the workers' bf16 plane is then the learner's model itself
    (rounded weights route a near-tie token otherwise: 1 of 178 on some draws)."""
    from transformers import AutoModelForCausalLM

    out = save_search_model(tmp_path_factory.mktemp("moe"), "lfm2_moe", seed=2)
    hf = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def policies(moe_dir):
    from transformers import AutoModelForCausalLM

    from worker_contract.worker.mlx_model import MlxPolicy
    from worker_contract.worker.model import PolicyModel

    hf = AutoModelForCausalLM.from_pretrained(moe_dir)
    state = get_plane("bf16").from_hf({k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"})
    tp = PolicyModel(moe_dir, threads=1, seed=1, device="cpu")
    tp.load_plane("bf16", state)
    mp = MlxPolicy(moe_dir, plane="bf16", seed=1, dtype="float32")
    mp.load_plane("bf16", state)
    hf.load_state_dict({k: torch.from_numpy(np.asarray(v, dtype=np.float32))
                        for k, v in get_plane("bf16").to_dense(state).items()}, strict=False)
    REFERENCE[:] = [hf.eval()]
    return {"torch": tp, "mlx": mp}


#: transformers' model on the workers' weights, the reference the records are held against
REFERENCE: list = []


def full_forward_routes(hf, ids: list[int]) -> np.ndarray:
    """uint8 [len(ids), layers, top_k]: one cache-free forward of ids through transformers' model on the same
    weights, the top-k taken here from the router logits it reports (no recorder involved)."""
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), output_router_logits=True)
    blocks = [m for m in hf.modules() if type(m).__name__ == "Lfm2MoeSparseMoeBlock"]
    assert len(out.router_logits) == len(blocks)
    per_layer = [torch.topk(logits.sigmoid() + block.expert_bias, block.gate.top_k, dim=-1).indices
                 for logits, block in zip(out.router_logits, blocks, strict=True)]
    return torch.stack(per_layer, dim=1).sort(dim=-1).values.to(torch.uint8).numpy()


def assert_recorded_as_forward(policy, prompt: list[int], samples, shape: RouteShape, least: int = 21) -> int:
    """Each sample's recorded routes equal a forward's of the same tokens, and the comparison is sharp: the
    same routes one token off, or with two layers swapped, would not pass. Returns the tokens checked."""
    checked = 0
    for s in samples:
        response = list(s.token_ids if hasattr(s, "token_ids") else s.response_ids)
        ids = list(prompt) + response
        mask = getattr(s, "loss_mask", None) or [1] * len(response)
        n = routed_response_tokens(mask)
        want = full_forward_routes(REFERENCE[0], ids)
        got = np.concatenate([s.prompt_routes, s.routes[:n]])
        assert got.shape == (len(prompt) + n, shape.layers, shape.top_k)
        assert np.array_equal(got, want[:len(got)]), np.argwhere((got != want[:len(got)]).any(axis=(1, 2)))[:5]
        if len(got) > 2:
            assert not np.array_equal(got[1:], want[:len(got) - 1]), "routes constant over tokens: test not sharp"
            assert not np.array_equal(got[:, ::-1], got), "routes equal across layers: test not sharp"
        checked += len(got)
    assert checked >= least
    return checked


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_single_turn_routes_are_the_forwards(policies, moe_dir, backend):
    import json

    policy = policies[backend]
    shape = route_shape(json.loads((moe_dir / "config.json").read_text()))
    prompt = [9, 11, 5, 12, 6, 13, 4]
    groups = policy.sample_many([prompt, prompt[:4]], N, temperature=1.0, top_p=1.0, max_new_tokens=BUDGET)
    for p, group in zip([prompt, prompt[:4]], groups, strict=True):
        assert_recorded_as_forward(policy, p, group, shape)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_episode_routes_are_the_forwards_tool_turns_included(policies, moe_dir, backend):
    import json

    policy = policies[backend]
    shape = route_shape(json.loads((moe_dir / "config.json").read_text()))
    prompt = [9, 11, 5, 12, 6, 13, 4]
    searched = 0
    for _ in range(6):
        eps, _ = policy.sample_episodes(prompt, N, temperature=1.0, top_p=1.0, max_new_tokens=48, search=search)
        assert_recorded_as_forward(policy, prompt, eps, shape)
        searched += sum(0 in e.loss_mask for e in eps)
        if searched >= 2:
            break
    assert searched, "no episode with a tool turn: the tool tokens' routes went unchecked"


def _reseed(policy, seed: int) -> None:
    if hasattr(policy, "generator"):
        policy.generator.manual_seed(seed)
    else:
        policy.key = mx.random.key(seed)


def _varied_search():
    """A search tool whose every answer differs, so no two samples' tool turns hold the same tokens."""
    words = itertools.cycle(["dmd gene", "protein kinase", "the cell", "a gene of the cell", "kinase in a cell"])
    return lambda query: f"Doc 1 {next(words)} is {next(words)}"


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_batched_groups_record_each_samples_own_routes(policies, moe_dir, backend):
    """Two groups of different prompt lengths decode in one batch (torch: rows left-padded), samples leave the
    batch at their tool turns and rejoin with their own documents: each sample's routes (its prompt's, once
    per group; its sampled and tool tokens) are a plain forward's of its own tokens, and decoding one sample
    at a time records the same routes."""
    import json

    policy = policies[backend]
    shape = route_shape(json.loads((moe_dir / "config.json").read_text()))
    prompts = [[9, 11, 5, 12, 6, 13, 4], [4, 13, 7]]
    searched, checked, lengths = 0, 0, set()
    for seed in range(6):
        runs = {}
        for batched in (True, False):
            _reseed(policy, seed)
            runs[batched], _ = policy.sample_episode_groups(prompts, N, temperature=1.0, top_p=1.0,
                                                                max_new_tokens=48, search=_varied_search(),
                                                                batched=batched)
        for prompt, group, alone in zip(prompts, runs[True], runs[False], strict=True):
            checked += assert_recorded_as_forward(policy, prompt, group, shape, least=1)
            assert all(e.prompt_routes is group[0].prompt_routes for e in group), "prompt routes once per group"
            for a, b in zip(group, alone, strict=True):
                assert a.response_ids == b.response_ids
                assert np.array_equal(a.routes, b.routes) and np.array_equal(a.prompt_routes, b.prompt_routes)
            searched += sum(len(e.searches) for e in group)
            lengths |= {len(e.response_ids) for e in group}
        if seed >= 1 and searched >= 4:
            break
    assert searched >= 2, "no tool turns: no sample left the batch and rejoined"
    assert checked > 100
    assert len(lengths) > 1, "every sample as long as every other: rows never left the batch at different steps"


def test_worker_record_carries_routes_the_learner_accepts(policies, moe_dir):
    """A record built the worker's way is version 2, and the learner's rules decode its routes back."""
    import json

    shape = route_shape(json.loads((moe_dir / "config.json").read_text()))
    tp = policies["torch"]
    prompt = [9, 11, 5, 12]
    eps, _ = tp.sample_episodes(prompt, N, temperature=1.0, top_p=1.0, max_new_tokens=32, search=search)
    blob = encode_routes(eps[0].prompt_routes, [e.routes for e in eps])
    rec = _record(prompt, [e.to_sample(1.0) for e in eps], blob)
    p, samples = decode_routes(rec, shape)
    assert np.array_equal(p, eps[0].prompt_routes)
    assert all(np.array_equal(a, e.routes) for a, e in zip(samples, eps, strict=True))


def _record(prompt, samples, blob, version: int = 3):
    from worker_contract.schema import RolloutRecord, SamplingParams

    return RolloutRecord(schema_version=2, routes=blob, run="rr", worker_id="w", group_id="g", policy_version=version,
                         plane="bf16", task="psqa", prompt_id="p", prompt_ids=prompt, samples=samples,
                         sampling=SamplingParams(temperature=1.0, max_new_tokens=64), created_at=0.0)


# -- the learner -------------------------------------------------------------------------------------------
def _recipe(backend: str = "hf", replay: bool = True):
    from trainer.config import AlgoConfig, ComputeConfig, OptimConfig, RecipeConfig, TrainConfig

    return RecipeConfig(name="t", task="psqa", optim=OptimConfig(lr=1e-3),
                        algo=AlgoConfig(max_new_tokens=64, routing_replay=replay),
                        train=TrainConfig(backend=backend), compute=ComputeConfig(micro_batch_size=3))


def _records_from_worker(tp, prompts):
    """Routed records of single-turn groups sampled by the torch worker (the learner's weights)."""
    from worker_contract.schema import Sample

    recs = []
    for prompt, group in zip(prompts, tp.sample_many(prompts, N, temperature=1.0, top_p=1.0,
                                                     max_new_tokens=BUDGET), strict=True):
        samples = [Sample(response_ids=c.token_ids, behavior_logprobs=c.logprobs, loss_mask=[1] * len(c.token_ids),
                          reward=float(i % 2), finish_reason=c.finish_reason) for i, c in enumerate(group)]
        recs.append(_record(prompt, samples, encode_routes(group[0].prompt_routes, [c.routes for c in group])))
    return recs


def _bent(rec, shape: RouteShape, rng: np.random.Generator):
    """The record with every routed token's experts replaced by other ones (still valid ids)."""
    p, samples = decode_routes(rec, shape)
    flip = lambda a: np.sort((a + rng.integers(1, shape.num_experts, size=a.shape[:-1])[..., None])  # noqa: E731
                             % shape.num_experts, axis=-1).astype(np.uint8)
    return rec.model_copy(update={"routes": encode_routes(flip(p), [flip(s) for s in samples])})


def test_replayed_forward_equals_normal_where_routes_agree_and_differs_where_not(policies, moe_dir):
    from trainer.backends.hf import HFBackend
    from trainer.step import collate

    tp = policies["torch"]
    recs = _records_from_worker(tp, [[9, 11, 5, 12, 6], [4, 13, 7]])
    on, off = HFBackend.load(moe_dir, _recipe(replay=True), device="cpu"), HFBackend.load(moe_dir, _recipe(replay=False),
                                                                                          device="cpu")
    shape = on.route_shape
    plain = off.logprobs(collate(recs))
    replayed = on.logprobs(collate(recs, routes=shape))
    mask = collate(recs).loss_mask.bool()
    assert (replayed - plain).abs()[mask].max() < 1e-5  # the worker's routes are the learner's own here
    assert torch.equal(on.logprobs(collate(recs)), plain)  # no routes in the batch: nothing replayed
    bent = [_bent(r, shape, np.random.default_rng(0)) for r in recs]
    moved = (on.logprobs(collate(bent, routes=shape)) - plain).abs()[mask]
    assert moved.max() > 1e-2 and (moved > 1e-4).float().mean() > 0.5
    ref = on.logprobs(collate(bent, routes=shape), reference=True)  # the frozen reference replays too
    assert (ref - on.logprobs(collate(bent, routes=shape))).abs().max() < 1e-5
    # the router still learns under replay: its weight gets a gradient through the gating weights
    from trainer.step import loss_fn

    tb = collate(bent, routes=shape)
    tb.ref_logp = ref
    gate = next(p for n, p in on.model.named_parameters() if n.endswith("feed_forward.gate.weight"))
    before = gate.detach().clone()
    on.train_step(tb, loss_fn(_recipe().algo))
    assert not torch.equal(gate.detach(), before)


def test_hf_and_megatron_replay_alike(policies, moe_dir):
    """The same bent routes through both native backends give the same log-probs (float32 on the CPU)."""
    from tests import megatron_cpu
    from trainer.backends.hf import HFBackend
    from trainer.backends.megatron import MegatronBackend
    from trainer.step import collate

    megatron_cpu.init_distributed()
    try:
        recs = _records_from_worker(policies["torch"], [[9, 11, 5, 12, 6], [4, 13, 7]])
        hf = HFBackend.load(moe_dir, _recipe("hf"), device="cpu")
        mg = MegatronBackend.load(moe_dir, _recipe("megatron"), device="cpu", attention="sdpa")
        shape = hf.route_shape
        assert mg.route_shape == shape
        bent = [_bent(r, shape, np.random.default_rng(1)) for r in recs]
        tb = collate(bent, routes=shape)
        a, b = hf.logprobs(tb), mg.logprobs(tb)
        assert (a - b).abs().max() < 1e-4, (a - b).abs().max()
        assert (a - hf.logprobs(collate(bent))).abs().max() > 1e-2  # and replay moved them, on both
        assert (b - mg.logprobs(collate(bent))).abs().max() > 1e-2
    finally:
        megatron_cpu.shutdown_distributed()


def test_slime_takes_the_routes_through_its_own_rollout_routing_replay(policies, moe_dir):
    """slime (both checked commits) replays `Sample.rollout_routed_experts`: [len(tokens) - 1, every layer,
    top_k]; the MoE layers' rows are the record's routes, and the launch asks slime to replay them."""
    import json

    from infra.slime_launch import objective_args
    from trainer.rollouts.pool import Group
    from trainer.slime_plugin.rollout import group_to_samples
    from trainer.slime_plugin.types import slime_types

    cfg = json.loads((moe_dir / "config.json").read_text())
    shape, layers = route_shape(cfg), cfg["num_hidden_layers"]
    rec = _records_from_worker(policies["torch"], [[9, 11, 5, 12, 6]])[0]
    Sample = slime_types()[0]
    samples = group_to_samples(Group("k", rec, 1, 0), group_index=0, first_index=0, Sample=Sample,
                               routes=(shape, layers))
    prompt, resp = decode_routes(rec, shape)
    for s, r in zip(samples, resp, strict=True):
        a = s.rollout_routed_experts
        assert a.shape == (len(s.tokens) - 1, layers, shape.top_k)
        assert np.array_equal(a[:, list(shape.moe_layers)][:len(prompt) + len(r)], np.concatenate([prompt, r]))
    assert "--use-rollout-routing-replay" in objective_args(_recipe("hf", replay=True))
    assert "--use-rollout-routing-replay" not in objective_args(_recipe("hf", replay=False))


def test_bench_runs_tiny_on_cpu(tmp_path):
    """bench.routing_replay's whole path on a tiny psqa base: every figure of every case is there."""
    import json

    from bench import routing_replay

    out = tmp_path / "rr.json"
    assert routing_replay.main(["--tiny", "--groups", "2", "--n", "4", "--budget", "48", "--reps", "1",
                                "--step-groups", "2", "--workers", "torch", "mlx", "--planes", "bf16",
                                "--cache", str(tmp_path / "cache"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["cases"]) == {"torch/bf16", "mlx/bf16"}
    for case in result["cases"].values():
        for way in ("without_replay", "with_replay"):
            assert case[way]["tokens"] > 0 and 0 <= case[way]["gate_dropped"] <= 1
        assert case["record_bytes"]["ratio"] > 1 and len(case["route_flips"]["per_layer"]) == 3
    assert result["step_time"]["with_replay_s"] > 0 and result["command"].startswith("python -m bench.routing_replay")
