"""One native learner step of LFM2.5-8B-A1B shapes (random weights) on one GPU: memory, step time, MFU.

    python -m bench.lfm2_step [--layers 8] [--rows 64 --prompt 128 --response 384]
    python -m bench.lfm2_step --tiny --device cpu      # a smoke run (tests/test_lfm2_step.py, megatron CPU shims)

The model is LFM2.5-8B-A1B's architecture (infra/slime_launch.KNOWN_HF_CONFIGS: hidden 2048, 32 experts,
top-4, vocab 65536, attention at 6 of 24 layers) cut to `--layers` layers, random weights (norms and router
randomised), saved as bf16 HF safetensors and loaded by the megatron backend as the learner loads any model;
then the quickstart's step through `MegatronBackend.train_step` (reference log-probs, policy forward and
backward, AdamW) on 64 rows of 128 + 384 tokens in 16384-token micro-batches, median of 3 steps after 2.
MFU counts the parameters a token passes through (the experts it is routed to, not all 32):
8 x active parameters x tokens / step time / the bf16 matmul rate measured here.

Memory of the whole model on one GPU is estimated from the measured run: the learner holds, per parameter,
bf16 weights (2 bytes), float32 master weights (4), float32 gradients (4), AdamW's two moments (8) and the
bf16 reference copy (2): 20 bytes; activations are the measured peak less that, scaled by depth.
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

REPO = Path(__file__).resolve().parent.parent
HF_ID = "LiquidAI/LFM2.5-8B-A1B"
STATE_BYTES_PER_PARAM = 20


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


def make_model_dir(layers: int, out: Path, device: str = "cuda", tiny: bool = False) -> dict:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import Lfm2MoeForCausalLM

    cfg = lfm2_config(layers, tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = Lfm2MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    randomize(model, norm_std=0.1)
    counts = param_counts({k: v.numel() for k, v in model.state_dict().items() if "inv_freq" not in k
                           and not k.endswith("lm_head.weight")}, cfg)
    model.save_pretrained(out)
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(out / "tokenizer.json"))
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"layers": layers, **counts}


def step(model_dir: Path, args, counts: dict, rate: float) -> dict:
    import torch

    from bench.megatron_gpu import synthetic_batch
    from trainer.algo import policy_loss
    from trainer.backends.base import micro_batches
    from trainer.backends.megatron import MegatronBackend
    from trainer.config import resolve

    cuda = args.device == "cuda"
    cfg = resolve("gsm8k", env={}, overrides={"model.dtype": "bfloat16" if cuda else "float32",
                                             "train.max_tokens_per_gpu": args.max_tokens_per_gpu})
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    backend = MegatronBackend.load(model_dir, cfg, device=args.device)
    load_s = time.perf_counter() - t0
    loaded_gib = torch.cuda.memory_allocated() / 2**30 if cuda else None
    batch = synthetic_batch(args.rows, args.prompt, args.response, backend.vocab_size)
    algo = cfg.algo

    def fn(lp, mb):
        return policy_loss(lp, mb.behavior_logp, mb.ref_logp, mb.advantages, mb.loss_mask, algo)

    times = []
    for i in range(2 + args.steps):
        sync()
        t0 = time.perf_counter()
        batch.ref_logp = backend.logprobs(batch, reference=True)
        metrics = backend.train_step(batch, fn)
        sync()
        dt = time.perf_counter() - t0
        print(f"  lfm2 {counts['layers']} layers step {i}: {dt:.3f} s loss {metrics['loss']:.4g}", flush=True)
        if i >= 2:
            times.append(dt)
    tokens = args.rows * (args.prompt + args.response)
    t = statistics.median(times)
    return {"load_s": load_s, "loaded_gib": loaded_gib, "step_s": t, "steps_s": times, "tokens": tokens,
            "tokens_per_s": tokens / t, "mfu_active": 8 * counts["active_params"] * tokens / t / (rate * 1e12),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "micro_batches": len(micro_batches(batch, cfg.train)), "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"]}


def extrapolate(measured: dict, full: dict, layers_measured: int, layers_full: int) -> dict:
    """The whole model's peak on one GPU from the measured cut: 20 bytes per parameter plus activations
    scaled by depth (the measured peak less the measured model's states)."""
    states = STATE_BYTES_PER_PARAM * measured["params"] / 2**30
    act = max(0.0, measured["peak_mem_gib"] - states)
    full_states = STATE_BYTES_PER_PARAM * full["params"] / 2**30
    return {"states_gib": full_states, "activations_gib": act * layers_full / layers_measured,
            "peak_gib": full_states + act * layers_full / layers_measured}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lfm2_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small shape and batch (smoke run on a CPU)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=384)
    ap.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "lfm2_step.json"))
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.rows, args.prompt, args.response, args.max_tokens_per_gpu = 4, 4, 8, 24, 64
    sys.path.insert(0, str(REPO))
    import torch

    from bench.common import machine_info
    from bench.megatron_gpu import matmul_tflops
    from trainer.backends.megatron import init_parallel

    cuda = args.device == "cuda"
    rate = matmul_tflops(args.device)  # NaN off CUDA
    init_parallel(0, 1, torch.device("cuda", 0) if cuda else torch.device("cpu"))
    result: dict = {"machine": machine_info(), "args": vars(args), "matmul_bf16_tflops": rate,
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
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        t0 = time.perf_counter()
        counts = make_model_dir(args.layers, Path(tmp) / "lfm2", args.device, args.tiny)
        counts["build_s"] = time.perf_counter() - t0
        result["measured"] = counts
        save()
        try:
            result["measured"].update(step(Path(tmp) / "lfm2", args, counts, rate))
        except Exception as e:  # an OOM is a result too
            import traceback

            result["measured"]["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            result["measured"]["traceback"] = traceback.format_exc()[-3000:]
            if cuda:
                result["measured"]["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if "step_s" in result["measured"] and cuda:
        result["full_estimate"] = extrapolate(result["measured"], result["full"], args.layers, 24)
        result["fits_one_gpu"] = result["full_estimate"]["peak_gib"] < 0.95 * result["gpu_memory_gib"]
    save()
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
