"""PULSE encode on the GPU: a Qwen2.5-1.5B-shaped bf16 state, an Adam-like update, encode timed on CUDA.

    python -m bench.pulse_gpu                      # on a CUDA machine: qwen2.5-1.5b shapes
    python -m bench.pulse_gpu --device cpu --shape tiny --out /tmp/x.json   # a smoke run anywhere

The state is random (std 0.02, norms at 1) in the exact tensor shapes of Qwen2.5-1.5B; the update moves
fp32 master weights by lr * u with |u| <= 1 (Adam's normalised step) at lr 1e-6, and both sides are cast
to bf16, so about 1-3% of the words change, like a real step. Timed, after a warm-up:
  device_s   the device work of every tensor (compare, nonzero, candidates, sort, gathers, deltas) and
             the copy of the compact streams to the host, byte-plane split included
  encode_s   the whole `encode_patch_torch` (device work + result digests on a thread pool + zstd)
Then the patch is applied on the CPU (numpy) and checked bit for bit against the new state.
Writes bench/results/pulse_gpu.json (GPU name, commit, timings, sizes).
"""

from __future__ import annotations

import argparse
import sys
import time

SHAPES = {
    # vocab, hidden, intermediate, layers, heads, kv heads (Qwen2.5-1.5B: tied embeddings, qkv biases)
    "qwen2.5-1.5b": (151936, 1536, 8960, 28, 12, 2),
    "tiny": (1024, 128, 384, 2, 4, 2),
}


def qwen_shapes(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int) -> dict[str, tuple]:
    head_dim = hidden // heads
    out = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,),
                p + "self_attn.k_proj.weight": (kv * head_dim, hidden), p + "self_attn.k_proj.bias": (kv * head_dim,),
                p + "self_attn.v_proj.weight": (kv * head_dim, hidden), p + "self_attn.v_proj.bias": (kv * head_dim,),
                p + "self_attn.o_proj.weight": (hidden, hidden), p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden), p + "mlp.down_proj.weight": (hidden, inter)}
    return out


def make_states(shapes: dict[str, tuple], device: str, lr: float = 1e-6, seed: int = 0):
    """(old, new) bf16 states on `device`: random weights, then one Adam-like step on fp32 masters."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    old, new = {}, {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            master = torch.ones(shape, device=device)
        else:
            master = torch.randn(shape, device=device, generator=g) * 0.02
        old[name] = master.to(torch.bfloat16)
        step = (torch.rand(shape, device=device, generator=g) * 2 - 1) * lr  # |u| <= 1, like Adam's m/sqrt(v)
        new[name] = (master - step).to(torch.bfloat16)
        del master, step
    return old, new


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(shape: str, device: str, hash_threads: int) -> dict:
    import numpy as np
    import torch

    from worker_contract.pulse import apply_patch, read_header
    from worker_contract.pulse.torch_encode import encode_patch_torch, encode_tensor_torch
    from worker_contract.tensors import state_entries, to_numpy, words

    torch.manual_seed(0)
    shapes = qwen_shapes(*SHAPES[shape])
    old, new = make_states(shapes, device)
    params = sum(t.numel() for t in new.values())
    state_bytes = sum(t.numel() * t.element_size() for t in new.values())
    old_cpu = {k: to_numpy(v.cpu()) for k, v in old.items()}
    base_entries = state_entries(old_cpu)  # the publisher holds these from its previous step

    encode_patch_torch(old, new, base_entries=base_entries, hash_threads=hash_threads)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    for name in sorted(new):
        encode_tensor_torch(old[name], new[name], "bfloat16")
    _sync(device)
    device_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    patch = encode_patch_torch(old, new, base_entries=base_entries, hash_threads=hash_threads)
    _sync(device)
    encode_s = time.perf_counter() - t0

    header = read_header(patch)
    t0 = time.perf_counter()
    back = apply_patch(old_cpu, patch, verified_base_digest=header.base_digest)
    apply_s = time.perf_counter() - t0
    exact = all(np.array_equal(words(back[k]), words(to_numpy(new[k].cpu()))) for k in new)
    changed = sum(t.changed for t in header.tensors)
    words_total = sum(t.count for t in header.tensors)
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else None
    return {"shape": shape, "device": device, "gpu": gpu, "params": params, "state_bytes": state_bytes,
            "hash_threads": hash_threads, "changed": changed, "sparsity": 1 - changed / words_total,
            "patch_bytes": len(patch), "ratio_full_over_patch": state_bytes / len(patch),
            "device_s": device_s, "encode_s": encode_s, "encode_gbps": state_bytes / 1e9 / encode_s,
            "apply_cpu_s": apply_s, "exact": exact, "under_1s": encode_s < 1.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pulse_gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="torch device (cuda, cuda:1, cpu)")
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--hash-threads", type=int, default=16, help="threads hashing the result on the host")
    parser.add_argument("--out", default=None, help="result path (default bench/results/pulse_gpu.json)")
    args = parser.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("pulse_gpu: no CUDA device here; run it on a GPU machine or pass --device cpu", file=sys.stderr)
        return 2
    from bench.common import write_result

    result = run(args.shape, args.device, args.hash_threads)
    print(f"{result['shape']} on {result['gpu'] or result['device']}: {result['params'] / 1e9:.2f} B params, "
          f"sparsity {result['sparsity']:.4f}, patch {result['patch_bytes']:,} B "
          f"({result['ratio_full_over_patch']:.0f}x smaller than the state), device {result['device_s']:.3f} s, "
          f"encode {result['encode_s']:.3f} s, exact {result['exact']}")
    print(f"wrote {write_result('pulse_gpu', result, args.out)}")
    return 0 if result["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
