"""PULSE patches on realistic RL updates: real AdamW steps at lr 1e-6 on a >=100M-parameter Qwen2-shaped model.

For two ways a learner holds its weights (fp32 masters cast to bf16, or bf16 parameters) and each plane
(bf16, int8g64): sparsity, patch size against full sync and simpler sparse codings, and encode / apply
throughput. Every patch and baseline is applied and checked bit for bit.

    python -m bench.pulse_bench [--steps 3] [--layers 12] [--out bench/results/pulse.json]
More in docs/performance.md (module notes).
"""

from __future__ import annotations

import argparse
import sys
import time

from worker_contract.cli import number

#: timed repetitions of our encode and apply (the best one's thread CPU time counts: the machine is shared)
REPS = 3


def _build_model(layers: int, hidden: int, vocab: int, dtype):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=4,
                      tie_word_embeddings=True, max_position_embeddings=512)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(dtype)


def _states(model, steps: int, vocab: int) -> list[dict]:
    """bf16 HF-named snapshots: before training and after each AdamW step (lr 1e-6, wd 0.01)."""
    import torch

    from trainer.publish.publisher import drop_aliases

    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    snap = lambda: {k: v.detach().to(torch.bfloat16).clone() for k, v in drop_aliases(model.state_dict()).items()}  # noqa: E731
    out = [snap()]
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 64), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(snap())
    return out


def _timed(fn, reps: int = 1):
    best_cpu, best_wall, res = float("inf"), float("inf"), None
    for _ in range(reps):
        c0, w0 = time.thread_time(), time.perf_counter()
        res = fn()
        best_cpu, best_wall = min(best_cpu, time.thread_time() - c0), min(best_wall, time.perf_counter() - w0)
    return res, best_cpu, best_wall


def _exact(a: dict, b: dict) -> bool:
    import numpy as np

    from worker_contract.tensors import words

    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and np.array_equal(words(a[k]), words(b[k])) for k in a)


def measure_pair(old: dict, new: dict) -> dict:
    """Every number for one (old, new) pair of plane states (numpy)."""
    from bench import baselines
    from worker_contract.pulse import apply_patch, encode_patch, read_header
    from worker_contract.tensors import state_entries

    nbytes = sum(a.nbytes for a in new.values())
    gb = nbytes / 1e9
    base_entries = state_entries(old)
    patch, enc_cpu, enc_wall = _timed(lambda: encode_patch(old, new, base_entries=base_entries), reps=REPS)
    header = read_header(patch)
    back, app_cpu, app_wall = _timed(lambda: apply_patch(old, patch, verified_base_digest=header.base_digest), REPS)
    _, cold_enc, _ = _timed(lambda: encode_patch(old, new))
    _, cold_app, _ = _timed(lambda: apply_patch(old, patch))
    changed = sum(t.changed for t in header.tensors)
    words_total = sum(t.count for t in header.tensors)
    full = baselines.full_sync(new)
    plain = baselines.sparse_plain_encode(old, new)
    pulse, pulse_enc, _ = _timed(lambda: baselines.pulse_style_encode(old, new))
    pulse_back, pulse_dec, _ = _timed(lambda: baselines.pulse_style_decode(old, pulse))
    return {
        "state_bytes": nbytes, "words": words_total, "changed": changed,
        "sparsity": 1 - changed / words_total, "tensors_with_context": sum(1 for t in header.tensors if t.threshold),
        "patch_bytes": len(patch), "bits_per_changed_word": 8 * len(patch) / max(changed, 1),
        "ratio_full_over_patch": nbytes / len(patch),
        "baselines": {
            "full_sync_safetensors_zstd1": {"bytes": len(full), "ratio_full_over": nbytes / len(full)},
            "sparse_int64_values_zstd1": {"bytes": len(plain), "ratio_full_over": nbytes / len(plain),
                                          "exact": _exact(baselines.sparse_plain_decode(old, plain), new)},
            "pulse_style_v31_zstd1": {"bytes": len(pulse), "ratio_full_over": nbytes / len(pulse),
                                      "bits_per_changed_word": 8 * len(pulse) / max(changed, 1),
                                      "encode_gbps": gb / pulse_enc, "decode_gbps": gb / pulse_dec,
                                      "exact": _exact(pulse_back, new)},
        },
        "smaller_than_pulse_style_x": len(pulse) / len(patch),
        "encode_gbps_cpu": gb / enc_cpu, "encode_gbps_wall": gb / enc_wall,
        "apply_gbps_cpu": gb / app_cpu, "apply_gbps_wall": gb / app_wall,
        "encode_gbps_cold_cpu": gb / cold_enc, "apply_gbps_cold_cpu": gb / cold_app,
        "exact": _exact(back, new),
    }


def run(steps: int, layers: int, hidden: int, vocab: int) -> dict:
    import torch

    from worker_contract.planes import get_plane

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    scenarios = {}
    for scen, dtype in (("fp32-master", torch.float32), ("bf16-params", torch.bfloat16)):
        t0 = time.perf_counter()
        model = _build_model(layers, hidden, vocab, dtype)
        params = sum(p.numel() for p in model.parameters())
        states = _states(model, steps, vocab)
        del model
        train_s = time.perf_counter() - t0
        planes = {}
        for plane_name in ("bf16", "int8g64"):
            plane = get_plane(plane_name)
            ps = [plane.from_hf(s) for s in states]
            pairs = [measure_pair(a, b) for a, b in zip(ps, ps[1:], strict=False)]
            planes[plane_name] = {"pairs": pairs, "summary": _summary(pairs)}
            print(f"{scen:12} {plane_name:8} " + _line(planes[plane_name]["summary"]), flush=True)
        scenarios[scen] = {"params": params, "train_s": train_s, "planes": planes}
    return {"model": {"layers": layers, "hidden": hidden, "vocab": vocab, "steps": steps, "lr": 1e-6,
                      "optimizer": "AdamW(wd=0.01)"}, "scenarios": scenarios}


def _summary(pairs: list[dict]) -> dict:
    mean = lambda k: sum(p[k] for p in pairs) / len(pairs)  # noqa: E731
    return {k: mean(k) for k in ("sparsity", "ratio_full_over_patch", "smaller_than_pulse_style_x",
                                 "bits_per_changed_word", "encode_gbps_cpu", "apply_gbps_cpu",
                                 "encode_gbps_cold_cpu", "apply_gbps_cold_cpu")} | {
        "pulse_style_ratio_full_over": sum(p["baselines"]["pulse_style_v31_zstd1"]["ratio_full_over"]
                                           for p in pairs) / len(pairs),
        "all_exact": all(p["exact"] and p["baselines"]["pulse_style_v31_zstd1"]["exact"] for p in pairs)}


def _line(s: dict) -> str:
    return (f"sparsity {s['sparsity']:.4f}  full/patch {s['ratio_full_over_patch']:.0f}x "
            f"(PULSE-style {s['pulse_style_ratio_full_over']:.0f}x, ours {s['smaller_than_pulse_style_x']:.2f}x smaller)  "
            f"{s['bits_per_changed_word']:.2f} bits/changed  encode {s['encode_gbps_cpu']:.2f} GB/s  "
            f"apply {s['apply_gbps_cpu']:.2f} GB/s  exact {s['all_exact']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pulse_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=number(int, at_least=1), default=3, help="AdamW steps per scenario")
    parser.add_argument("--layers", type=number(int, at_least=1), default=12)
    parser.add_argument("--hidden", type=number(int, at_least=1), default=768)
    parser.add_argument("--vocab", type=number(int, at_least=1), default=32768)
    parser.add_argument("--out", default=None, help="result path (default bench/results/pulse.json)")
    args = parser.parse_args(argv)
    from bench.common import write_result

    result = run(args.steps, args.layers, args.hidden, args.vocab)
    print(f"wrote {write_result('pulse', result, args.out, argv=argv)}")
    ok = all(p["summary"]["all_exact"] for s in result["scenarios"].values() for p in s["planes"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
