"""MLX worker vs torch worker on one machine: sampling throughput and agreement with the learner.

    python -m bench mlx_worker [--model DIR] [--groups 6] [--out bench/results/mlx_worker.json]
More in docs/mac-worker.md (module notes).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from worker_contract.cli import number

from .common import write_result

PLANES = ("bf16", "int8g64")
WORKERS = (("torch", "torch", None), ("mlx-float32", "mlx", "float32"), ("mlx-bfloat16", "mlx", "bfloat16"))


def _base_model(cfg) -> Path:
    from embedded.basemodel import ensure_base
    from embedded.run import STOA_DIR
    from worker_contract.tasks import get_task

    rep = ensure_base(cfg.embedded.base, get_task(cfg.task), STOA_DIR / "cache", max_new_tokens=cfg.algo.max_new_tokens,
                      eval_problems=cfg.embedded.eval_problems)
    return Path(rep.path)


def _publish(store, cfg, model_dir: Path):
    from transformers import AutoModelForCausalLM

    from trainer.models.identity import identity_from_hf
    from trainer.publish.publisher import Publisher
    from trainer.run_init import run_manifest
    from worker_contract import signing
    from worker_contract.manifest import create_or_resume

    key = signing.generate_private_key()
    manifest = create_or_resume(store, run_manifest(cfg, identity_from_hf(model_dir), signing.public_key_b64(key)),
                                resume=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    Publisher(store, manifest, key, anchor_interval=10, progress=False).publish_anchor(model.state_dict())
    return manifest


def measure_plane(plane: str, model_dir: Path, groups: int, seed: int = 0) -> dict:
    from embedded.config import resolve_embedded
    from trainer.backends import get_backend
    from trainer.rollouts.audit import WorkerAudit
    from trainer.step import collate
    from worker_contract.store.file import FileStore
    from worker_contract.worker.loop import Worker, WorkerSettings

    cfg = resolve_embedded("gsm8k", env={}, overrides={"run": "bench-mlx", "contract.plane": plane})
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(model_dir), "hf_id": None})})
    with tempfile.TemporaryDirectory() as tmp:
        store = FileStore(Path(tmp) / "bucket")
        manifest = _publish(store, cfg, model_dir)
        env = {"DRL_N_SAMPLES": str(manifest.n_samples), "DRL_PULSE_PLANE": plane}
        workers = {}
        for name, backend, dtype in WORKERS:
            over = {"mlx_dtype": dtype} if dtype else {}
            w = Worker(WorkerSettings(store=store.url, run=cfg.run, model_dir=str(model_dir), worker_id=name,
                                      seed=seed, threads=1, backend=backend, **over), env=env)
            assert w.setup(threading.Event())
            workers[name] = w
        train = next(iter(workers.values())).task.dataset("train")
        rng = np.random.default_rng(seed)
        problems = [train[int(i)] for i in rng.integers(0, len(train), size=groups)]
        records: dict[str, list] = {name: [] for name in workers}
        for p in problems:  # interleaved: the same load on every worker
            for name, w in workers.items():
                records[name].extend(w.sample_groups([p]))
        learner = get_backend("hf").load(model_dir, cfg, device="cpu")
        out = {}
        for name, w in workers.items():
            recs = records[name]
            lp = learner.logprobs(collate(recs)).float().numpy()
            diffs, row = [], 0
            for r in recs:
                for s in r.samples:
                    n = len(s.response_ids)
                    diffs.extend(np.abs(lp[row, :n] - np.asarray(s.behavior_logprobs)).tolist())
                    row += 1
            audit = WorkerAudit(max_groups=len(recs))
            audit.observe(recs, lp[:, :max(len(s.response_ids) for r in recs for s in r.samples)].tolist())
            st = audit.stats()[name]
            d = np.asarray(diffs)
            out[name] = {
                "tokens": w.stats.tokens, "sampling_s": round(w.stats.sampling_s, 3),
                "tokens_per_s": round(w.stats.tokens / w.stats.sampling_s, 1),
                "groups": len(recs), "mean_reward": float(np.mean([s.reward for r in recs for s in r.samples])),
                "abs_logprob_diff": {"mean": float(d.mean()), "p99": float(np.quantile(d, 0.99)), "max": float(d.max()),
                                     "tokens": int(d.size)},
                "audit": {"logprob_mismatch": st["logprob_mismatch"], "flagged": st["flagged"]},
            }
        return out


#: the recipes' models as Macs run them (config.json facts; Qwen2.5-1.5B and LFM2.5-8B-A1B from the recipes)
MEMORY_MODELS = {
    "Qwen/Qwen2.5-0.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896,
        "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "vocab_size": 151936, "tie_word_embeddings": True},
}


def memory_rows(n_samples: int = 8, tokens: int = 1024 + 256) -> dict:
    """Bytes an MLX worker holds per model and plane, from the model's shapes (nothing allocated): the
    weights as the MLX model holds them, the reconstructor's copy of the plane (the same size: it verifies
    and patches the published tensors), and the KV cache of one group (n_samples rows of `tokens`)."""
    import json

    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from infra.slime_launch import KNOWN_HF_CONFIGS
    from worker_contract.worker.mlx_model import build_model

    configs = dict(MEMORY_MODELS)
    configs["Qwen/Qwen2.5-1.5B-Instruct"] = {**KNOWN_HF_CONFIGS["Qwen/Qwen2.5-1.5B-Instruct"],
                                             "architectures": ["Qwen2ForCausalLM"]}
    configs["LiquidAI/LFM2.5-8B-A1B"] = {**KNOWN_HF_CONFIGS["LiquidAI/LFM2.5-8B-A1B"],
                                         "architectures": ["Lfm2MoeForCausalLM"], "max_position_embeddings": 128000}
    out = {}
    for name, cfg in configs.items():
        row = {}
        with tempfile.TemporaryDirectory() as d:
            Path(d, "config.json").write_text(json.dumps(cfg))
            for plane in PLANES:
                model, _, _ = build_model(d)  # lazy: shapes only
                if plane == "int8g64":
                    nn.quantize(model, group_size=64, bits=8, class_predicate=lambda _p, m: hasattr(m, "to_quantized")
                                and m.weight.shape[-1] % 64 == 0)
                params = dict(tree_flatten(model.parameters()))
                count = sum(a.size for k, a in params.items() if not k.endswith((".scales", ".biases"))
                            or plane == "bf16")
                nbytes = sum(a.size * (a.dtype.size if a.dtype.size != 4 or "uint32" in str(a.dtype) else 2)
                             for a in params.values())  # floats as bf16, as published
                row[plane] = {"weights_gb": round(nbytes / 1e9, 2), "with_plane_copy_gb": round(2 * nbytes / 1e9, 2)}
                row["parameters"] = count if plane == "bf16" else row["parameters"]
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        attn = sum(1 for t in cfg.get("layer_types", ["full_attention"] * cfg["num_hidden_layers"])
                   if t == "full_attention")
        kv_bytes = attn * 2 * kv * (cfg["hidden_size"] // heads) * 2 * n_samples * tokens
        row["kv_cache_gb_bf16"] = round(kv_bytes / 1e9, 3)
        out[name] = row
    return {"n_samples": n_samples, "tokens_per_row": tokens, "models": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench mlx_worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: the embedded run's cached base)")
    ap.add_argument("--groups", type=number(int, at_least=1), default=6, help="groups per worker and plane")
    ap.add_argument("--out", default=None, help="result file (default bench/results/mlx_worker.json)")
    args = ap.parse_args(argv)
    import torch

    from embedded.config import resolve_embedded

    torch.set_num_threads(1)  # as the embedded run's workers
    cfg = resolve_embedded("gsm8k", env={}, overrides={"run": "bench-mlx"})
    model_dir = Path(args.model) if args.model else _base_model(cfg)
    t0 = time.monotonic()
    planes = {}
    for plane in PLANES:
        planes[plane] = measure_plane(plane, model_dir, args.groups)
        for name, r in planes[plane].items():
            d = r["abs_logprob_diff"]
            print(f"{plane:8s} {name:13s} {r['tokens_per_s']:8.1f} tokens/s   |dlogp| mean {d['mean']:.2e} "
                  f"p99 {d['p99']:.2e} max {d['max']:.2e}   audit {r['audit']['logprob_mismatch']:.2e} "
                  f"flagged={r['audit']['flagged']}", flush=True)
    import mlx.core as mx

    path = write_result("mlx_worker", {
        "model": str(model_dir), "groups_per_worker": args.groups, "n_samples": cfg.contract.n_samples,
        "max_new_tokens": cfg.algo.max_new_tokens, "temperature": cfg.algo.temperature,
        "mlx": mx.__version__, "mlx_device": str(mx.default_device()), "torch_threads": 1,
        "wall_s": round(time.monotonic() - t0, 1), "planes": planes, "memory": memory_rows(),
    }, args.out, argv=argv)
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
