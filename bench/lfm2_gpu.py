"""bf16 parity of our megatron-core LFM2-MoE against transformers' Lfm2MoeForCausalLM, on a GPU.

    python bench/lfm2_gpu.py                     # LFM2.5-8B-A1B-like shape, 8 layers, bf16, cuda
    python bench/lfm2_gpu.py --layers 24         # the full depth (about 17 GB of bf16 weights, twice)

Both models get the same random weights (norms, router and expert bias randomised too), the same
tokens; we report what an RL learner cares about: the per-token log-prob difference of the sampled
(here: given) tokens, the logit difference, top-1 agreement, and the KL between the two next-token
distributions, plus forward time. Results go to bench/results/lfm2_gpu.json. The CPU test
(tests/test_lfm2_megatron.py) runs it with --tiny after installing megatron's CPU shims.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from worker_contract.cli import number

REPO = Path(__file__).resolve().parent.parent


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=number(int, at_least=1), default=8)
    p.add_argument("--hidden", type=number(int, at_least=1), default=2048)
    p.add_argument("--experts", type=number(int, at_least=1), default=32)
    p.add_argument("--topk", type=number(int, at_least=1), default=4)
    p.add_argument("--moe-ffn", type=number(int, at_least=1), default=1792)
    p.add_argument("--dense-ffn", type=number(int, at_least=1), default=7168)
    p.add_argument("--vocab", type=number(int, at_least=1), default=65536)
    p.add_argument("--batch", type=number(int, at_least=1), default=4)
    p.add_argument("--seq", type=number(int, at_least=1), default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small shape for a CPU smoke run")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "lfm2_gpu.json"))
    return p


def hf_config(args):
    """LFM2.5-8B-A1B's architecture (bench.lfm2_step.lfm2_config) in the shape the flags give."""
    from bench.lfm2_step import lfm2_config

    if args.tiny:
        args.layers, args.hidden, args.experts, args.topk = 4, 64, 8, 2
        args.moe_ffn, args.dense_ffn, args.vocab, args.batch, args.seq = 32, 128, 256, 2, 32
    heads = max(4, args.hidden // 64)
    return lfm2_config(args.layers, hidden_size=args.hidden, intermediate_size=args.dense_ffn,
                       moe_intermediate_size=args.moe_ffn, num_attention_heads=heads,
                       num_key_value_heads=max(1, heads // 4), num_experts=args.experts,
                       num_experts_per_tok=args.topk, vocab_size=args.vocab)


def _init_distributed(device: str) -> None:
    import os

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if device.startswith("cuda"):  # before NCCL comes up, and with an index ("cuda" alone is refused)
        torch.cuda.set_device(torch.device(device).index or 0)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if device.startswith("cuda"):
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


def run(args) -> dict:
    import torch
    from transformers import Lfm2MoeForCausalLM

    from bench.lfm2_step import randomize
    from trainer.models.model import build_model, load_full_state
    from trainer.models.registry import get_architecture

    dtype = getattr(torch, args.dtype)
    cfg = hf_config(args)
    torch.manual_seed(0)
    hf = Lfm2MoeForCausalLM(cfg).eval()
    randomize(hf, norm_std=0.2)
    cdict = cfg.to_dict()
    state = {k: v.detach().clone() for k, v in hf.state_dict().items() if "inv_freq" not in k}
    hf = hf.to(device=args.device, dtype=dtype)
    _init_distributed(args.device)
    arch = get_architecture(cdict)
    mg = build_model(cdict, dtype=dtype, attention="sdpa", fused=False, device=args.device.split(":")[0])
    load_full_state(mg, {k: v.to(dtype) if not k.endswith("expert_bias") else v
                         for k, v in arch.hf_to_megatron(state, cdict, cfg.vocab_size).items()})
    mg = mg.to(args.device).eval()
    del state
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen).to(args.device)
    pos = torch.arange(args.seq, device=args.device)[None].expand(args.batch, -1)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        ref = hf(ids).logits.float()
        sync()
        t0 = time.perf_counter()
        ref = hf(ids).logits.float()
        sync()
        t_hf = time.perf_counter() - t0
        out = mg(ids, pos, attention_mask=None).float()
        sync()
        t0 = time.perf_counter()
        out = mg(ids, pos, attention_mask=None).float()
        sync()
        t_mg = time.perf_counter() - t0
    lp_ref, lp_out = ref.log_softmax(-1), out.log_softmax(-1)
    nxt = ids[:, 1:]
    tok_ref = lp_ref[:, :-1].gather(-1, nxt[..., None]).squeeze(-1)
    tok_out = lp_out[:, :-1].gather(-1, nxt[..., None]).squeeze(-1)
    dlp = (tok_out - tok_ref).abs()
    kl = (lp_ref.exp() * (lp_ref - lp_out)).sum(-1)
    return {
        "shape": {"layers": args.layers, "hidden": args.hidden, "experts": args.experts, "topk": args.topk,
                  "vocab": cfg.vocab_size, "batch": args.batch, "seq": args.seq},
        "dtype": args.dtype, "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "logit_max_abs_diff": float((out - ref).abs().max()),
        "logit_mean_abs_diff": float((out - ref).abs().mean()),
        "token_logprob_max_abs_diff": float(dlp.max()),
        "token_logprob_mean_abs_diff": float(dlp.mean()),
        "ratio_max_abs_dev": float((dlp.exp() - 1).max()),
        "top1_agreement": float((out.argmax(-1) == ref.argmax(-1)).float().mean()),
        "kl_mean": float(kl.mean()),
        "forward_s": {"transformers": t_hf, "megatron": t_mg},
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench.common import write_result

    out = write_result("lfm2_gpu", run(args), args.out, argv, "bench.lfm2_gpu")  # commit, machine, command
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
