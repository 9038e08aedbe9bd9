"""Does AdamW with bf16 moments learn as with float32 ones? Loss curves of a small LFM2-MoE on the CPU.

    python -m bench.lfm2_moments [--steps 300 --seeds 3]     # bench/results/lfm2_moments_cpu.json

A transformers Lfm2MoeForCausalLM (4 layers, hidden 64, 8 experts top-2, vocab 256) computes in bf16; the
learner's MasterAdamW (trainer/backends/megatron_optim.py) updates float32 masters with moments in float32
or bfloat16 (beta2 0.999, the recipes'). The data: next-token prediction on sequences of a fixed random
Markov chain (each token has 4 likely successors), so the loss has far to fall. Same initial weights and
data order per seed for both; within noise means the paired difference (bf16 - fp32) of the mean loss over
the last 50 steps is small against the spread of that figure between seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from worker_contract.cli import number

REPO = Path(__file__).resolve().parent.parent


def _model(seed: int):
    import torch
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Lfm2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1,
                        num_experts=8, num_experts_per_tok=2,
                        layer_types=["conv", "full_attention", "conv", "full_attention"])
    cfg._attn_implementation = "sdpa"
    return Lfm2MoeForCausalLM(cfg).to(torch.bfloat16).train()


def _chain(vocab: int = 256, fan: int = 4):
    import torch

    g = torch.Generator().manual_seed(1234)
    nxt = torch.randint(0, vocab, (vocab, fan), generator=g)
    return nxt


def _batch(nxt, gen, rows: int = 16, length: int = 64):
    import torch

    tok = torch.randint(0, nxt.shape[0], (rows,), generator=gen)
    out = [tok]
    for _ in range(length - 1):
        pick = torch.randint(0, nxt.shape[1], (rows,), generator=gen)
        tok = nxt[tok, pick]
        out.append(tok)
    return torch.stack(out, 1)


def train(moments: str, seed: int, steps: int, lr: float) -> list[float]:
    import torch
    import torch.nn.functional as F

    from trainer.backends.megatron_optim import MasterAdamW

    model = _model(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = MasterAdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8, moments=moments)
    nxt, gen = _chain(), torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = _batch(nxt, gen)
        logits = model(ids).logits.float()
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch._foreach_add_(opt.grads, [p.grad.float() for p in params])
        for p in params:
            p.grad = None
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lfm2_moments", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=number(int, at_least=1), default=300)
    ap.add_argument("--seeds", type=number(int, at_least=1), default=3)
    ap.add_argument("--lr", type=number(float, above=0), default=1e-3)
    ap.add_argument("--tail", type=number(int, at_least=1), default=50, help="steps averaged at the end")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "lfm2_moments_cpu.json"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    from bench.common import machine_info

    torch.set_num_threads(2)
    curves: dict[str, dict[int, list[float]]] = {"float32": {}, "bfloat16": {}}
    t0 = time.perf_counter()
    for seed in range(args.seeds):
        for moments in curves:
            curves[moments][seed] = train(moments, seed, args.steps, args.lr)
            print(f"seed {seed} {moments}: first {curves[moments][seed][0]:.3f} "
                  f"last-{args.tail} {statistics.mean(curves[moments][seed][-args.tail:]):.4f}", flush=True)
    tail = {m: [statistics.mean(c[s][-args.tail:]) for s in range(args.seeds)] for m, c in curves.items()}
    paired = [b - a for a, b in zip(tail["float32"], tail["bfloat16"], strict=True)]
    spread = statistics.stdev(tail["float32"]) if args.seeds > 1 else float("nan")
    result = {"command": "python -m bench.lfm2_moments " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine_info(), "args": vars(args), "seconds": time.perf_counter() - t0,
              "tail_mean_loss": tail, "paired_diff_bf16_minus_fp32": paired,
              "mean_paired_diff": statistics.mean(paired), "seed_stdev_fp32": spread,
              "within_noise": abs(statistics.mean(paired)) <= spread if args.seeds > 1 else None,
              "curves": {m: {str(s): v for s, v in c.items()} for m, c in curves.items()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("curves", "machine")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
