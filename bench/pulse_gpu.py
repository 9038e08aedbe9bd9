"""PULSE encode on the GPU, through the publisher's own path: a Qwen2.5-1.5B-shaped state on CUDA.

    python -m bench.pulse_gpu                      # on a CUDA machine: qwen2.5-1.5b shapes, bf16 plane
    python -m bench.pulse_gpu --plane int8g64      # the quantized plane (quantized on the GPU too)
    python -m bench.pulse_gpu --device cpu --shape tiny --out /tmp/x.json   # a smoke run anywhere

Times a publish of a random state moved as by a real AdamW step (the plane, the whole encode, the device
work alone), checks the patch bit for bit and writes bench/results/pulse_gpu.json.
More in docs/performance.md (module notes).
"""

from __future__ import annotations

import argparse
import sys
import time

from worker_contract.cli import number

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


def make_steps(shapes: dict[str, tuple], device: str, n: int, lr: float = 1e-6, seed: int = 0) -> list[dict]:
    """`n` successive bf16 HF-named states on `device`: random fp32 masters, then Adam-like steps."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    masters = {name: (torch.ones(shape, device=device) if name.endswith("norm.weight")
                      else torch.randn(shape, device=device, generator=g) * 0.02) for name, shape in shapes.items()}
    out = []
    for i in range(n):
        if i:
            for m in masters.values():  # |u| <= 1, like Adam's m / sqrt(v)
                m.sub_((torch.rand(m.shape, device=device, generator=g) * 2 - 1) * lr)
        out.append({name: m.to(torch.bfloat16) for name, m in masters.items()})
    del masters
    return out


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _manifest(run: str, plane: str, shape: str, key):
    from worker_contract import signing
    from worker_contract.manifest import RunManifest

    vocab, hidden, _inter, layers, heads, kv = SHAPES[shape]
    return RunManifest(
        run=run, n_samples=8, plane=plane, task="bench", model_id=f"{shape}-shaped", architecture="Qwen2ForCausalLM",
        rope_theta=1_000_000.0, vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, tokenizer_digest="0" * 64, chat_template_digest="0" * 64, temperature=1.0,
        max_new_tokens=64, staleness=1, anchor_interval=1000, trainer_public_key=signing.public_key_b64(key))


def run(shape: str, device: str, plane: str, hash_threads: int | None = None) -> dict:
    """Publish three steps through the publisher's device path; time the third (see the module doc)."""
    import tempfile

    import numpy as np
    import torch

    from trainer.publish.publisher import Publisher
    from worker_contract import layout, signing
    from worker_contract.manifest import create_or_resume
    from worker_contract.planes import get_plane
    from worker_contract.pulse import apply_patch, read_header
    from worker_contract.pulse.torch_encode import encode_tensor_torch
    from worker_contract.store import open_store
    from worker_contract.tensors import to_numpy, words

    torch.manual_seed(0)
    if not device.startswith("cuda"):
        torch.set_num_threads(1)  # the CPU smoke run: tiny tensors, where intra-op threads only cost
    shapes = qwen_shapes(*SHAPES[shape])
    steps = make_steps(shapes, device, 3)
    params = sum(t.numel() for t in steps[0].values())
    with tempfile.TemporaryDirectory(prefix="pulse-gpu-") as tmp:
        store = open_store(f"file://{tmp}")
        key = signing.generate_private_key()
        manifest = _manifest("bench-gpu", plane, shape, key)
        create_or_resume(store, manifest, resume=False)
        encoder = "auto" if device.startswith("cuda") else "torch"
        pub = Publisher(store, manifest, key, anchor_interval=1000, progress=False, encoder=encoder)
        if hash_threads:
            pub.hash_threads = hash_threads
        pub.publish_anchor(steps[0])
        pub.publish(steps[1])  # warm-up: kernels, allocator, thread pool
        base_host = {k: to_numpy(v) for k, v in pub._base.items()}  # v2, as a worker holds it
        _sync(device)
        done = pub.publish(steps[2])
        _sync(device)
        version, stats = done.version, dict(done.stats)
        patch = store.get(layout.patch_key(manifest.run, version))
        want = get_plane(plane).from_hf_torch(steps[2])
        _sync(device)
        t0 = time.perf_counter()
        base_dev = get_plane(plane).from_hf_torch(steps[1])
        for name in sorted(want):
            encode_tensor_torch(base_dev[name], want[name], str(want[name].dtype).removeprefix("torch."))
        _sync(device)
        device_s = time.perf_counter() - t0
    header = read_header(patch)
    t0 = time.perf_counter()
    back = apply_patch(base_host, patch, verified_base_digest=header.base_digest)
    apply_s = time.perf_counter() - t0
    exact = all(np.array_equal(words(back[k]), words(to_numpy(want[k]))) for k in want)
    changed = sum(t.changed for t in header.tensors)
    words_total = sum(t.count for t in header.tensors)
    state_bytes = stats["full_bytes"]
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None
    return {"shape": shape, "device": device, "gpu": gpu, "plane": plane, "params": params,
            "state_bytes": state_bytes, "encoder": stats["encoder"], "hash_threads": pub.hash_threads,
            "changed": changed, "sparsity": 1 - changed / words_total, "patch_bytes": len(patch),
            "ratio_full_over_patch": state_bytes / len(patch), "plane_s": stats["plane_s"],
            "encode_s": stats["encode_s"], "encode_gbps": state_bytes / 1e9 / stats["encode_s"],
            "device_s": device_s, "publish_latency_s": stats["latency_s"], "apply_cpu_s": apply_s,
            "exact": exact, "under_1s": stats["encode_s"] < 1.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pulse_gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="torch device (cuda, cuda:1, cpu)")
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--plane", default="bf16", choices=["bf16", "int8g64"])
    parser.add_argument("--hash-threads", type=number(int, at_least=1), default=None,
                        help="host threads copying and hashing the result (default: the publisher's, up to 16)")
    parser.add_argument("--out", default=None, help="result path (default bench/results/pulse_gpu.json)")
    args = parser.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("pulse_gpu: no CUDA device here; run it on a GPU machine or pass --device cpu", file=sys.stderr)
        return 2
    from bench.common import write_result

    result = run(args.shape, args.device, args.plane, args.hash_threads)
    print(f"{result['shape']} {result['plane']} on {result['gpu'] or result['device']}: "
          f"{result['params'] / 1e9:.2f} B params, "
          f"sparsity {result['sparsity']:.4f}, patch {result['patch_bytes']:,} B "
          f"({result['ratio_full_over_patch']:.0f}x smaller than the state), plane {result['plane_s']:.3f} s, "
          f"publisher encode {result['encode_s']:.3f} s (device work alone {result['device_s']:.3f} s), "
          f"exact {result['exact']}")
    print(f"wrote {write_result('pulse_gpu', result, args.out, argv=argv)}")
    return 0 if result["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
