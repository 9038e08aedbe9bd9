"""`python -m bench.routing_replay`: what MoE routing replay changes, on the embedded psqa model (CPU).

Torch and MLX workers on the bf16 and int8g64 planes sample the same psqa episodes (same base, prompts,
seeds) and record routes; the learner (hf, float32, the same weights) scores the same records without and
with replay: log-prob mismatch on trained tokens (mean |d|, p99, max, k3 KL(mu || p)), the DPPO gate's
drops (tv 0.2 / 0.2), the share of tokens whose top-k set differs (any layer, per layer), record bytes per
group, and the learner's step time each way. bench/results/routing_replay.json (`--tiny`: tests).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from worker_contract.cli import number

DEFAULT_CACHE = Path("/tmp/stoa-bench-cache")


def _base(cache: Path, tiny: bool, sft_steps: int | None = None, model: str | None = None) -> tuple[Path, list, object]:
    """(model dir, train problems, search) of the embedded psqa run (built and cached on first use; `model`,
    another LFM2-MoE, is used as it is)."""
    from embedded.psqa_base import PsqaBaseConfig, ensure_psqa_base, load_problems
    from embedded.psqa_synth import write_dataset
    from infra.retriever.index import BM25Index
    from worker_contract.tasks.psqa_retrieval import format_hits

    data = cache / ("data-tiny" if tiny else "data")
    if not (data / "test.jsonl").exists():
        write_dataset(data, n_entities=80 if tiny else 3000, heldout_entities=8 if tiny else 200,
                      pool=20 if tiny else 300)
    index = BM25Index.build(json.loads(line) for line in open(data / "corpus.jsonl"))
    search = lambda q: format_hits(index.search(q, 3))  # noqa: E731 - what the retriever answers, in process
    cfg = PsqaBaseConfig(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, moe_intermediate_size=32,
                         vocab_size=300, tokenizer_traces=60, sft_steps=4, short_steps=2, sft_batch_size=4,
                         eval_questions=2, max_new_tokens=48) if tiny else PsqaBaseConfig()
    if sft_steps is not None:  # the same model, supervised for fewer steps (a loaded machine's budget)
        cfg = cfg.model_copy(update={"sft_steps": sft_steps, "short_steps": sft_steps * 3 // 4, "eval_questions": 8})
    model_dir = Path(model) if model else ensure_psqa_base(data, cache, search, cfg=cfg, log=print)[0]
    _, train, _ = load_problems(data)
    return Path(model_dir), train, search


def _worker(kind: str, model_dir: Path, plane: str, seed: int, device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    from worker_contract.planes import get_plane

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tied = bool(getattr(hf.config, "tie_word_embeddings", False))
    state = get_plane(plane).from_hf({k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()
                                      if not (tied and k == "lm_head.weight")})
    if kind == "torch":
        from worker_contract.worker.model import PolicyModel

        policy = PolicyModel(model_dir, threads=1, seed=seed, device=device)
    else:
        from worker_contract.worker.mlx_model import MlxPolicy

        policy = MlxPolicy(model_dir, plane=plane, seed=seed, dtype="float32")
    policy.load_plane(plane, state)
    return policy


def sample_records(policy, problems, search, *, n: int, budget: int, max_turns: int, plane: str) -> list:
    """One routed record per problem, sampled as the worker's loop does (worker/loop.py's record layout)."""
    from worker_contract.routes import encode_routes, routed_response_tokens
    from worker_contract.schema import RolloutRecord, SamplingParams
    from worker_contract.tasks import get_task

    task, out = get_task("psqa"), []
    for i, problem in enumerate(problems):
        prompt = policy.prompt_ids(task.messages(problem))
        eps, _ = policy.sample_episodes(prompt, n, temperature=1.0, top_p=1.0, max_new_tokens=budget, search=search,
                                        max_turns=max_turns)
        samples = [e.to_sample(task.reward(e.text, problem)) for e in eps]
        routes = encode_routes(eps[0].prompt_routes, [e.routes[:routed_response_tokens(s.loss_mask)]
                                                      for e, s in zip(eps, samples, strict=True)])
        out.append(RolloutRecord(schema_version=2, routes=routes, run="bench", worker_id="w", group_id=f"g{i}",
                                 policy_version=1, plane=plane, task="psqa", prompt_id=problem.id, prompt_ids=prompt,
                                 samples=samples, created_at=time.time(),
                                 sampling=SamplingParams(temperature=1.0, max_new_tokens=budget)))
    return out


def _recipe(replay: bool, budget: int):
    from trainer.config import AlgoConfig, ComputeConfig, GateConfig, OptimConfig, RecipeConfig, TrainConfig

    return RecipeConfig(name="psqa", task="psqa", optim=OptimConfig(lr=3e-5), algo=AlgoConfig(
        groups_per_step=4, max_new_tokens=budget, eps_clip=10000, eps_clip_high=19, eps_clip_c=20,
        gate=GateConfig(divergence="tv", delta_low=0.2, delta_high=0.2), routing_replay=replay),
        train=TrainConfig(backend="hf"), compute=ComputeConfig(dtype="float32", micro_batch_size=32))


def route_flips(learner_model, records, shape) -> dict:
    """Share of routed tokens whose top-k set differs between the records and the learner's own forward."""
    import numpy as np
    import torch

    from worker_contract.routes import decode_routes
    from worker_contract.worker.route_recorder import TorchRouteRecorder

    rec_hook = TorchRouteRecorder(learner_model, shape)
    differ, tokens = np.zeros(shape.layers), 0
    any_layer = 0
    for rec in records:
        prompt, samples = decode_routes(rec, shape)
        for s, resp in zip(rec.samples, samples, strict=True):
            ids = list(rec.prompt_ids) + list(s.response_ids)
            with torch.no_grad():
                learner_model(input_ids=torch.tensor([ids], device=learner_model.device))
            mine = rec_hook.take()[0]
            got = np.concatenate([prompt, resp])
            d = (mine[:len(got)] != got).any(axis=-1)  # [tokens, layers]
            differ += d.sum(axis=0)
            any_layer += int(d.any(axis=-1).sum())
            tokens += len(got)
    return {"tokens": tokens, "any_layer": any_layer / max(tokens, 1),
            "per_layer": [round(float(x) / max(tokens, 1), 5) for x in differ]}


def mismatch(backend, records, shape, replay: bool, gate) -> dict:
    """Learner vs recorded log-probs on trained tokens; `mean_abs` is the figure the worker audit keeps."""
    from trainer.algo import dppo_keep_mask, k3_kl
    from trainer.step import collate

    tb = collate(records, routes=shape if replay else None)
    lp = backend.logprobs(tb).float().cpu()  # the batch stays on the host; the learner may run on a GPU
    mask = tb.loss_mask.bool()
    d = (lp - tb.behavior_logp)[mask].double()
    keep = dppo_keep_mask(lp, tb.behavior_logp, tb.advantages[:, None], gate.delta_low, gate.delta_high,
                          gate.divergence)
    return {"tokens": int(mask.sum()), "mean_abs": float(d.abs().mean()), "p99_abs": float(d.abs().quantile(0.99)),
            "max_abs": float(d.abs().max()),
            "k3_kl_mu_p": float(k3_kl(tb.behavior_logp, lp)[mask].double().mean()),
            "gate_dropped": float((~keep)[mask].double().mean()),
            "gate_dropped_tokens": int((~keep)[mask].sum())}


def step_times(model_dir: Path, records, budget: int, reps: int, device: str = "cpu") -> dict:
    """Median seconds of a learner step (reference log-probs and the optimizer step) without and with replay
    on the same batch, the two interleaved rep by rep so a change of the machine's load hits both alike."""
    import torch

    from trainer.backends.hf import HFBackend
    from trainer.step import collate, loss_fn

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ways = {replay: (HFBackend.load(model_dir, _recipe(replay, budget), device=device), _recipe(replay, budget))
            for replay in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps + 1):
        for replay, (backend, cfg) in ways.items():
            tb = collate(records, routes=backend.route_shape if replay else None)
            t0 = time.perf_counter()
            tb.ref_logp = backend.logprobs(tb, reference=True)
            backend.train_step(tb, loss_fn(cfg.algo))
            sync()
            times[replay].append(time.perf_counter() - t0)
    off, on = statistics.median(times[False][1:]), statistics.median(times[True][1:])  # the first warms up
    return {"groups": len(records), "reps": reps, "without_replay_s": off, "with_replay_s": on,
            "slowdown": on / off - 1, "raw_s": {"without_replay": times[False], "with_replay": times[True]}}


def record_bytes(records) -> dict:
    from worker_contract.schema import encode_record

    routed = [len(encode_record(r)) for r in records]
    plain = [len(encode_record(r.model_copy(update={"routes": None, "schema_version": 1}))) for r in records]
    return {"with_routes_mean": statistics.mean(routed), "without_routes_mean": statistics.mean(plain),
            "ratio": statistics.mean(routed) / statistics.mean(plain)}


def run(args) -> dict:
    import random

    import torch

    from trainer.backends.hf import HFBackend

    torch.set_num_threads(args.threads)
    # --model: another LFM2-MoE on the same generated questions
    model_dir, train, search = _base(Path(args.cache), args.tiny, args.sft_steps, args.model)
    problems = random.Random(args.seed).sample(list(train), args.groups)
    learner = HFBackend.load(model_dir, _recipe(True, args.budget), device=args.device)
    shape, gate = learner.route_shape, _recipe(True, args.budget).algo.gate
    out: dict = {"model_dir": str(model_dir), "route_shape": {"moe_layers": list(shape.moe_layers),
                 "num_experts": shape.num_experts, "top_k": shape.top_k}, "cases": {}}
    all_records = []
    for kind in args.workers:
        for plane in args.planes:
            t0 = time.perf_counter()
            records = sample_records(_worker(kind, model_dir, plane, args.seed, args.device), problems, search, n=args.n,
                                     budget=args.budget, max_turns=args.max_turns, plane=plane)
            case = {"sampling_s": round(time.perf_counter() - t0, 1),
                    "without_replay": mismatch(learner, records, shape, False, gate),
                    "with_replay": mismatch(learner, records, shape, True, gate),
                    "route_flips": route_flips(learner.model, records, shape), "record_bytes": record_bytes(records)}
            wo, w = case["without_replay"], case["with_replay"]
            case["mean_abs_ratio"] = w["mean_abs"] / max(wo["mean_abs"], 1e-12)
            out["cases"][f"{kind}/{plane}"] = case
            print(f"{kind}/{plane}: mean|d| {wo['mean_abs']:.5f} -> {w['mean_abs']:.5f}, p99 {wo['p99_abs']:.4f} -> "
                  f"{w['p99_abs']:.4f}, gate drops {wo['gate_dropped']:.4%} -> {w['gate_dropped']:.4%}, routes "
                  f"differ on {case['route_flips']['any_layer']:.2%} of tokens, bytes x{case['record_bytes']['ratio']:.2f}",
                  flush=True)
            all_records.extend(records[: max(1, args.step_groups // (len(args.workers) * len(args.planes)))])
    batch = all_records[: args.step_groups]
    st = out["step_time"] = step_times(model_dir, batch, args.budget, args.reps, args.device)
    print(f"learner step ({len(batch)} groups): {st['without_replay_s']:.3f} s without replay, "
          f"{st['with_replay_s']:.3f} s with ({st['slowdown']:+.1%})")
    return out


def main(argv: list[str] | None = None) -> int:
    from .common import write_result

    p = argparse.ArgumentParser(prog="python -m bench.routing_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=number(int, at_least=1), default=16, help="psqa groups per worker and plane (the same problems)")
    p.add_argument("--n", type=number(int, at_least=1), default=8, help="samples per group (the recipe's n_samples)")
    p.add_argument("--budget", type=number(int, at_least=1), default=160, help="max_new_tokens (the embedded psqa run's)")
    p.add_argument("--max-turns", type=number(int, at_least=1), default=2)
    p.add_argument("--workers", nargs="+", default=["torch", "mlx"], choices=["torch", "mlx"])
    p.add_argument("--planes", nargs="+", default=["bf16", "int8g64"], choices=["bf16", "int8g64"])
    p.add_argument("--step-groups", type=number(int, at_least=1), default=4, help="groups in the timed learner step")
    p.add_argument("--reps", type=number(int, at_least=1), default=5, help="timed learner steps each way, interleaved (after one warm-up)")
    p.add_argument("--seed", type=number(int, at_least=0), default=0)
    p.add_argument("--threads", type=number(int, at_least=1), default=2)
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="where the generated data and the base are cached")
    p.add_argument("--tiny", action="store_true", help="a random tiny base of a few SFT steps (tests)")
    p.add_argument("--model", default=None, help="another LFM2-MoE HF directory instead of the embedded psqa base "
                   "(the larger-model run: --model DIR --device cuda --workers torch)")
    p.add_argument("--sft-steps", type=number(int, at_least=1), default=None, help="supervise the base for this many steps instead "
                   "of its 1000 (same model and data)")
    p.add_argument("--device", default="cpu", help="the learner's and the torch worker's device (cpu, cuda)")
    p.add_argument("--out", default=None, help="result file (default bench/results/routing_replay.json)")
    args = p.parse_args(argv)
    if args.model and not (Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there; give an LFM2-MoE HF directory")
    from .common import provenance

    tree = provenance()  # the code that runs: the checkout may move on during a long run
    result = run(args)
    name = "routing_replay" + ("_tiny" if args.tiny else "") + ("_gpu" if args.device == "cuda" else "")
    path = write_result(name, result, args.out, argv=argv, tree=tree)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
