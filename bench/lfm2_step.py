"""The fleet model's native learner step on one GPU: LFM2.5-8B-A1B shapes (random weights), the fleet
recipe's batch and memory plan; peak memory, step time, tokens/s, MFU, and the plan's candidates.

    python -m bench.lfm2_step                            # 24 layers, psqa's batch: 64 rows of 256 + 4096
    python -m bench.lfm2_step --tiny --device cpu        # a smoke run (tests/test_lfm2_step.py)
More in docs/performance.md (module notes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from worker_contract.cli import number

REPO = Path(__file__).resolve().parent.parent
HF_ID = "LiquidAI/LFM2.5-8B-A1B"
#: the H200's dense bf16 tensor-core peak by its datasheet (TFLOP/s)
SPEC_TFLOPS = 989.0


#: the smoke shape (`--tiny`): the architecture's features at a size a CPU steps in seconds
TINY = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "num_experts": 8, "num_experts_per_tok": 2}


def lfm2_config(layers: int, tiny: bool = False, **shape):
    """LFM2.5-8B-A1B's architecture cut to its first `layers` layers (at least one of them attention),
    `TINY` over it where `tiny`, then `shape` (other HF config values)."""
    from transformers import Lfm2MoeConfig

    from infra.slime_launch import KNOWN_HF_CONFIGS

    facts = {k: v for k, v in KNOWN_HF_CONFIGS[HF_ID].items() if k != "model_type"}
    if not 1 <= layers <= len(facts["layer_types"]):
        raise ValueError(f"layers={layers}: {HF_ID} has {len(facts['layer_types'])} layers; give 1 to that many")
    facts.update({**(TINY if tiny else {}), **shape})
    facts["layer_types"] = facts["layer_types"][:layers]
    if "full_attention" not in facts["layer_types"]:
        facts["layer_types"][-1] = "full_attention"
    facts["num_hidden_layers"] = layers
    facts["num_dense_layers"] = min(facts["num_dense_layers"], layers - 1)
    return Lfm2MoeConfig(**facts, architectures=["Lfm2MoeForCausalLM"])


def randomize(model, *, norm_std: float) -> None:
    """Random values, in place, where a fresh Lfm2MoeForCausalLM has constants or near-zeros: norm weights
    about 1 (std `norm_std`), a router gate wide enough that tokens pick different experts, and the experts'
    routing bias; so a comparison or a step sees what trained weights would exercise (bench.lfm2_gpu too)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, norm_std)
            elif name.endswith("feed_forward.gate.weight"):
                p.normal_(0.0, 0.3 / model.config.hidden_size ** 0.5 * 8)
        for name, b in model.named_buffers():
            if "expert_bias" in name:
                b.normal_(0.0, 0.05)


def param_counts(total: dict[str, int], cfg) -> dict[str, float]:
    """All parameters, and those one token passes through (top-k of the routed experts)."""
    n = sum(total.values())
    experts = sum(v for k, v in total.items() if ".experts." in k)
    active = n - experts * (1 - cfg.num_experts_per_tok / cfg.num_experts)
    return {"params": n, "expert_params": experts, "active_params": active}


def random_model(cfg, device: str):
    """A bf16 LFM2-MoE of `cfg` on `device`, randomised as above (seed 0), and its parameter counts."""
    import torch
    from transformers import Lfm2MoeForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Lfm2MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    randomize(model, norm_std=0.1)
    counts = param_counts({k: v.numel() for k, v in model.state_dict().items() if "inv_freq" not in k
                           and not k.endswith("lm_head.weight")}, cfg)
    return model, counts


def make_model_dir(layers: int, out: Path, device: str = "cuda", tiny: bool = False) -> dict:
    import torch
    from tokenizers import Tokenizer, models

    model, counts = random_model(lfm2_config(layers, tiny), device)
    model.save_pretrained(out)
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(out / "tokenizer.json"))
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"layers": layers, **counts}


def recipe(args):
    """runs/psqa-decoupled resolved for the native engine's megatron backend, with `--set` overrides."""
    from trainer.config import resolve

    over = {"train.engine": "native", "train.backend": "megatron",
            "model.dtype": "bfloat16" if args.device == "cuda" else "float32"}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            over[key] = json.loads(value)
        except json.JSONDecodeError:
            over[key] = value
    return resolve("psqa", env={}, overrides=over)


def _loss_fn(algo):
    from trainer.objectives import policy_loss

    return lambda lp, mb: policy_loss(lp, mb.behavior_logp, mb.ref_logp, mb.advantages, mb.loss_mask, algo)


class _Timer:
    """Wall time of the optimizer's step inside train_step (synchronised around it on a GPU)."""

    def __init__(self, rank, sync):
        self.times: list[float] = []
        inner = rank.optimizer.step

        def timed(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = inner(*a, **k)
            sync()
            self.times.append(time.perf_counter() - t0)
            return out

        rank.optimizer.step = timed


def run_steps(backend, batch, cfg, n_warm: int, n: int, sync, label: str) -> dict:
    """`n_warm` + `n` learner steps (reference log-probs, then train_step); medians of the last `n`."""
    import torch

    rank = backend._local
    timer = getattr(rank, "_bench_timer", None) or _Timer(rank, sync)
    rank._bench_timer = timer
    fn = _loss_fn(cfg.algo)
    rows = []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for i in range(n_warm + n):
        sync()
        t0 = time.perf_counter()
        batch.ref_logp = backend.logprobs(batch, reference=True)
        sync()
        t1 = time.perf_counter()
        metrics = backend.train_step(batch, fn)
        sync()
        t2 = time.perf_counter()
        rows.append({"step_s": t2 - t0, "ref_s": t1 - t0, "train_s": t2 - t1, "optimizer_s": timer.times[-1]})
        print(f"  {label} step {i}: {t2 - t0:.3f} s (reference {t1 - t0:.3f}, optimizer {timer.times[-1]:.3f}) "
              f"loss {metrics['loss']:.4g}", flush=True)
    timed = rows[n_warm:] or rows
    out = {k: statistics.median(r[k] for r in timed) for k in rows[0]}
    out.update(steps=rows, loss=metrics["loss"], grad_norm=metrics["grad_norm"])
    if torch.cuda.is_available():
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def profile_step(backend, batch, cfg, sync, out_path: Path, top: int = 40) -> dict:
    """One more learner step under torch.profiler: the kernels by self device time (table written beside the
    result as <out>.profile.txt; the top 15 kept in the result), so the next change aims at what costs."""
    from torch.profiler import ProfilerActivity, profile

    fn = _loss_fn(cfg.algo)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda() else [])
    sync()
    with profile(activities=acts) as prof:
        batch.ref_logp = backend.logprobs(batch, reference=True)
        backend.train_step(batch, fn)
        sync()
    key = "self_cuda_time_total" if _cuda() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=top)
    out_path.write_text(table + "\n")
    events = list(prof.key_averages())
    if events and not hasattr(events[0], key):  # torch 2.11 names the device's total self_device_time_total
        key = "self_device_time_total"
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) or 1
    return {"table": out_path.name, "sorted_by": key, "top": [
        {"name": e.key[:120], "share": round(getattr(e, key) / total, 4), "count": e.count,
         "ms": round(getattr(e, key) / 1000, 2)} for e in events[:15]]}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def rates(out: dict, tokens: int, active: float, rate: float) -> dict:
    flops = 8 * active * tokens / out["step_s"]
    return {"tokens": tokens, "tokens_per_s": tokens / out["step_s"], "mfu_measured": flops / (rate * 1e12),
            "mfu_spec": flops / (SPEC_TFLOPS * 1e12)}


def plan_placement(rank) -> dict:
    """Where the plan put the optimizer's states, read off the optimizer's own tensors."""
    import torch

    opt = rank.optimizer
    if not hasattr(opt, "bytes_by_place"):
        return {"optimizer": type(opt).__name__, "masters_on": str(rank.masters[0].device)}
    host = sorted(opt.on_host)
    return {"optimizer": type(opt).__name__, **{f"{k}_gib": v / 2**30 for k, v in opt.bytes_by_place().items()},
            "moment_dtype": str(opt.moment_dtype), "host_params": len(host), "all_params": len(opt.params),
            "host_states_pinned": all(opt.masters[i].is_pinned() for i in host) if torch.cuda.is_available() else None,
            "grads_on": str(opt.grads[0].device)}


def compare(backend, args, cfg, counts, rate, sync) -> dict:
    """The recipe's step on fewer rows: grouped GEMMs, the experts' loop, and grouped with recompute."""
    from bench.megatron_gpu import synthetic_batch
    from trainer.backends.megatron_rank import set_recompute
    from trainer.models.lfm2_experts import set_grouped

    rank = backend._local
    batch = synthetic_batch(args.compare_rows, args.prompt, args.response, backend.vocab_size, seed=1)
    tokens = args.compare_rows * (args.prompt + args.response)
    out = {}
    for label, grouped, recompute in (("grouped", True, False), ("loop", False, False),
                                      ("grouped+recompute", True, True)):
        set_grouped(rank.model, grouped)
        set_grouped(rank.reference, grouped)
        rank.recompute = set_recompute(rank.model, recompute)
        try:
            r = run_steps(backend, batch, cfg, 1, 1, sync, label)
            r.update(rates(r, tokens, counts["active_params"], rate))
        except Exception as e:  # an OOM is a result too
            r = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        out[label] = r
        gc.collect()
    set_grouped(rank.model, True)
    set_grouped(rank.reference, True)
    rank.recompute = set_recompute(rank.model, cfg.compute.gradient_checkpointing)
    return out


def measure(args, result: dict, save) -> None:
    import torch

    from bench.megatron_gpu import synthetic_batch
    from trainer.backends.base import micro_batches
    from trainer.backends.megatron import MegatronBackend

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = recipe(args)
    result["train"] = cfg.train.model_dump()
    result["optim"] = cfg.optim.model_dump()
    parts = set(args.parts.split(","))
    if "optim" in parts:
        from bench import lfm2_optim

        result["optimizer_candidates"] = lfm2_optim.run(args.optim_elements, args.device, result["full"]["params"])
        save()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        t0 = time.perf_counter()
        counts = make_model_dir(args.layers, Path(tmp) / "lfm2", args.device, args.tiny)
        counts["build_s"] = time.perf_counter() - t0
        result["measured"] = counts
        save()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        backend = MegatronBackend.load(Path(tmp) / "lfm2", cfg, device=args.device)
        counts["load_s"] = time.perf_counter() - t0
    rank = backend._local
    counts["loaded_gib"] = torch.cuda.memory_allocated() / 2**30 if cuda else None
    counts["plan"] = plan_placement(rank)
    save()
    if "step" in parts:
        batch = synthetic_batch(args.rows, args.prompt, args.response, backend.vocab_size)
        counts["micro_batches"] = len(micro_batches(batch, cfg.compute))
        r = run_steps(backend, batch, cfg, 1, args.steps, sync, f"lfm2 {args.layers} layers")
        r.update(rates(r, args.rows * (args.prompt + args.response), counts["active_params"], result["matmul_bf16_tflops"]))
        result["step"] = r
        save()
        if "profile" in parts:
            result["profile"] = profile_step(backend, batch, cfg, sync, Path(args.out).with_suffix(".profile.txt"))
            save()
        del batch
    if "compare" in parts:
        result["compare"] = compare(backend, args, cfg, counts, result["matmul_bf16_tflops"], sync)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lfm2_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=number(int, at_least=1), default=24)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small shape and batch (smoke run on a CPU)")
    ap.add_argument("--rows", type=number(int, at_least=1), default=64, help="8 groups x 8 episodes")
    ap.add_argument("--prompt", type=number(int, at_least=1), default=256)
    ap.add_argument("--response", type=number(int, at_least=1), default=4096, help="the psqa recipe's max_new_tokens")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
    ap.add_argument("--parts", default="optim,step,compare")
    ap.add_argument("--steps", type=number(int, at_least=1), default=2, help="timed steps after one warm-up")
    ap.add_argument("--compare-rows", type=number(int, at_least=1), default=8)
    ap.add_argument("--optim-elements", type=number(float, above=0), default=1.0e9, help="parameters of each optimizer candidate")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "lfm2_step.json"))
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.rows, args.prompt, args.response, args.compare_rows = 4, 4, 8, 24, 2
        args.optim_elements = 2e7
        args.set = ["compute.micro_batch_size=2", *args.set]
    sys.path.insert(0, str(REPO))
    import torch

    from bench.common import machine_info
    from bench.megatron_gpu import matmul_tflops
    from trainer.backends.megatron import init_parallel

    cuda = args.device == "cuda"
    rate = matmul_tflops(args.device)  # NaN off CUDA
    init_parallel(0, 1, torch.device("cuda", 0) if cuda else torch.device("cpu"))
    result: dict = {"command": "python -m bench.lfm2_step " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "machine": machine_info(), "args": vars(args), "matmul_bf16_tflops": rate,
                    "spec_bf16_tflops": SPEC_TFLOPS,
                    "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None}
    out = Path(args.out)

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")

    full_cfg = lfm2_config(24, args.tiny)
    with torch.device("meta"):
        from transformers import Lfm2MoeForCausalLM

        meta = Lfm2MoeForCausalLM(full_cfg)
    result["full"] = {"layers": 24, **param_counts({k: v.numel() for k, v in meta.state_dict().items()
                                                     if "inv_freq" not in k and not k.endswith("lm_head.weight")},
                                                    full_cfg)}
    del meta
    try:
        measure(args, result, save)
    except Exception as e:  # an OOM is a result too
        import traceback

        result["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        result["traceback"] = traceback.format_exc()[-3000:]
        if cuda:
            result["peak_mem_gib_at_error"] = torch.cuda.max_memory_allocated() / 2**30
    save()
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "traceback")}, indent=1,
                     default=str)[:6000], flush=True)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
