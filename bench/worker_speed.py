"""`python -m bench.worker_speed decode|swap|memory|start`: the workers at full speed (issue 38), on this CPU.

decode: forwards per sampled token and tokens/s of psqa groups one sample at a time vs together, and of
  gsm8k-style groups, both workers, with mlx-lm's `batch_generate` on the same prompts (tiny LFM2-MoE).
swap: pause and bytes per version at LFM2.5-8B-A1B shapes on int8g64, layer-scaled (8192 of 65536
  embedding rows, 1 dense layer, 1 MoE layer with 4 of its 32 experts; each part timed alone and scaled),
  an Adam-sized step through the publisher's CPU path (plane.from_hf, encode_patch).
memory: the MLX worker's RSS through a join, a follow and a psqa group at those shapes, and the estimate.
start: a process building the torch worker's model at those shapes (--layers), in turn with a random init.
Results in bench/results/worker_speed_<part>.json; docs/performance.md (Workers at full speed, Process start-up).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HIDDEN, VOCAB, EXPERTS, MOE_I, DENSE_I, LAYERS, DENSE_LAYERS = 2048, 65536, 32, 1792, 7168, 24, 2
#: experts built per MoE layer (each of the 32 has the same shapes: a part's cost is scaled by EXPERTS / BUILT)
BUILT = 4
#: swap: each part's rewrite is timed this many times (the median; a rewrite of the same values is idempotent)
SWAP_REPS = 9
#: embedding rows built (the "other" part, the embedding alone but for a norm, is scaled by VOCAB / VOCAB_BUILT)
VOCAB_BUILT = 8192


# -- decode ---------------------------------------------------------------------------------------------
def _count_forwards(policy):
    """A counter of the model's forward calls (torch: a pre-hook on the input embedding; MLX: a wrapper)."""
    box = [0]
    if hasattr(policy, "generator"):
        policy.model.get_input_embeddings().register_forward_pre_hook(lambda *_: box.__setitem__(0, box[0] + 1))
    else:
        inner = policy.model

        class Counting:
            def __call__(self, *a, **k):
                box[0] += 1
                return inner(*a, **k)

            def __getattr__(self, name):
                return getattr(inner, name)

        policy.model = Counting()
    return box


def decode(groups: int, n: int, budget: int, device: str = "cpu", workers: tuple[str, ...] = ("torch", "mlx")) -> dict:
    from worker_contract.worker.model import PolicyModel

    from .psqa_episodes import search_setup

    d, state, search, srv = search_setup("worker-speed-", "lfm2_moe")
    tp = PolicyModel(d, threads=1, seed=1, device=device)
    policies = [("torch", tp)]
    if "mlx" in workers:  # a CUDA box has no mlx: --workers torch leaves it out
        from worker_contract.worker.mlx_model import MlxPolicy

        policies.append(("mlx", MlxPolicy(d, plane="bf16", seed=1, dtype="float32")))
    policies = [(k, pol) for k, pol in policies if k in workers]
    prompts = [tp.chat.encode(q) for q in ("Question: the dmd gene is", "Question: a protein kinase in the cell",
                                           "Question: the cell of a gene", "Question: is the kinase a protein")]
    prompts = [prompts[i % len(prompts)] for i in range(groups)]
    out: dict = {}
    for name, pol in policies:
        pol.load_plane("bf16", state)
        fwd = _count_forwards(pol)
        res = {}
        for mode, batched in (("psqa_one_at_a_time", False), ("psqa_together", True)):
            f0, t0 = fwd[0], time.perf_counter()
            g, count = pol.sample_episode_groups(prompts, n, temperature=1.0, top_p=1.0, max_new_tokens=budget,
                                                 search=search, batched=batched)
            secs = time.perf_counter() - t0
            toks = sum(sum(e.loss_mask) for eps in g for e in eps)
            res[mode] = {"forwards": fwd[0] - f0, "sampled_tokens": toks, "seconds": round(secs, 2),
                         "forwards_per_token": round((fwd[0] - f0) / toks, 3), "tokens_per_s": round(toks / secs, 1),
                         "searches": sum(len(e.searches) for eps in g for e in eps), "turns": count.turns,
                         "extension_forwards": count.extensions}
        f0, t0 = fwd[0], time.perf_counter()
        outs = pol.sample_many(prompts, n, temperature=1.0, top_p=1.0, max_new_tokens=budget)
        secs, toks = time.perf_counter() - t0, sum(len(o.token_ids) for grp in outs for o in grp)
        res["gsm8k_style_group"] = {"forwards": fwd[0] - f0, "sampled_tokens": toks, "seconds": round(secs, 2),
                                    "forwards_per_token": round((fwd[0] - f0) / toks, 3),
                                    "tokens_per_s": round(toks / secs, 1), "note": "single-turn: batched before and after"}
        if name == "mlx":
            from mlx_lm.generate import batch_generate
            from mlx_lm.tokenizer_utils import TokenizerWrapper

            f0, t0 = fwd[0], time.perf_counter()
            r = batch_generate(pol.model, TokenizerWrapper(pol.tokenizer, eos_token_ids=set(pol.eos_ids)), [p for p in prompts for _ in range(n)], max_tokens=budget,
                               return_token_ids=True)
            secs = time.perf_counter() - t0
            toks = sum(len(t) for t in r.token_ids) if getattr(r, "token_ids", None) else None
            res["mlx_lm_batch_generate"] = {"forwards": fwd[0] - f0, "sampled_tokens": toks, "seconds": round(secs, 2),
                                            "tokens_per_s": round(toks / secs, 1) if toks else None,
                                            "forwards_per_token": round((fwd[0] - f0) / toks, 3) if toks else None}
        out[name] = res
        for k, v in res.items():
            print(f"{name} {k}: {v}", flush=True)
    srv.shutdown()
    srv.server_close()
    return out


# -- swap -----------------------------------------------------------------------------------------------
def _bf16(x: np.ndarray) -> np.ndarray:
    from worker_contract.tensors import round_to

    return round_to(x, "bfloat16").reshape(x.shape)


def _hf_shapes(fused: bool, moe_layers: int, dense_layers: int) -> dict[str, tuple[int, ...]]:
    h, out = HIDDEN, {"model.embed_tokens.weight": (VOCAB_BUILT, HIDDEN), "model.embedding_norm.weight": (HIDDEN,)}
    for i in range(dense_layers + moe_layers):
        p = f"model.layers.{i}."
        out[p + "operator_norm.weight"] = out[p + "ffn_norm.weight"] = (h,)
        if i == 1:  # one attention layer (6 of the 24 are), the others gated short convs
            kv = max(1, h // 64 // 4) * 64
            for s, rows in (("q_proj", h), ("k_proj", kv), ("v_proj", kv), ("out_proj", h)):
                out[f"{p}self_attn.{s}.weight"] = (rows, h)
            out[p + "self_attn.q_layernorm.weight"] = out[p + "self_attn.k_layernorm.weight"] = (64,)
        else:
            out[p + "conv.conv.weight"], out[p + "conv.in_proj.weight"] = (h, 1, 3), (3 * h, h)
            out[p + "conv.out_proj.weight"] = (h, h)
        f = p + "feed_forward."
        if i < dense_layers:
            out[f + "w1.weight"] = out[f + "w3.weight"] = (DENSE_I, h)
            out[f + "w2.weight"] = (h, DENSE_I)
            continue
        out[f + "gate.weight"], out[f + "expert_bias"] = (BUILT, h), (BUILT,)
        if fused:
            out[f + "experts.gate_up_proj"], out[f + "experts.down_proj"] = (BUILT, 2 * MOE_I, h), (BUILT, h, MOE_I)
        else:
            for e in range(BUILT):
                out[f"{f}experts.{e}.w1.weight"] = out[f"{f}experts.{e}.w3.weight"] = (MOE_I, h)
                out[f"{f}experts.{e}.w2.weight"] = (h, MOE_I)
    return out


def _two_versions(shapes, seed: int = 0):
    """bf16 states before and after one Adam-sized step (each fp32 master weight moved by +-1e-6)."""
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for name, shape in shapes.items():
        w = (rng.standard_normal(shape, dtype=np.float32) * 0.02) if len(shape) > 1 else np.ones(shape, np.float32)
        old[name] = _bf16(w)
        w -= np.float32(1e-6) * np.sign(rng.standard_normal(shape, dtype=np.float32))
        new[name] = _bf16(w)
    return old, new


def _config(d: Path, fused: bool) -> None:
    import json

    from tests.episode_fixtures import save_tokenizer

    types = ["conv", "full_attention"]
    cfg = {"architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "vocab_size": VOCAB_BUILT,
           "hidden_size": HIDDEN, "intermediate_size": DENSE_I, "moe_intermediate_size": MOE_I,
           "num_hidden_layers": 2, "num_attention_heads": HIDDEN // 64, "num_key_value_heads": max(1, HIDDEN // 256),
           "norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": True, "num_dense_layers": 1,
           "num_experts": BUILT, "num_experts_per_tok": min(4, BUILT), "use_expert_bias": True, "norm_topk_prob": True,
           "conv_L_cache": 3, "conv_bias": False, "layer_types": types, "max_position_embeddings": 4096,
           "eos_token_id": 0, "pad_token_id": 0}
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    save_tokenizer(d)


def swap(worker: str) -> dict:
    """One dense layer (0) and one MoE layer (1, attention): each part's patch-only swap timed alone."""
    from worker_contract.planes import get_plane
    from worker_contract.pulse import apply_patch, encode_patch

    fused = worker == "torch"
    plane = get_plane("int8g64")
    old_hf, new_hf = _two_versions(_hf_shapes(fused, 1, 1))
    t0 = time.perf_counter()
    old, new = plane.from_hf(old_hf), plane.from_hf(new_hf)
    del old_hf, new_hf
    plane_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    patch = encode_patch(old, new, base_version=1, target_version=2)
    encode_s = time.perf_counter() - t0
    changes: dict = {}
    t0 = time.perf_counter()
    new = apply_patch(old, patch, changes_out=changes)
    apply_s = time.perf_counter() - t0
    d = Path(tempfile.mkdtemp(prefix="worker-speed-swap-"))
    _config(d, fused)
    if worker == "mlx":
        from worker_contract.worker.mlx_model import MlxPolicy

        pol = MlxPolicy(d, plane="int8g64", seed=0, dtype="bfloat16")
    else:
        from worker_contract.worker.model import PolicyModel

        pol = PolicyModel(d, threads=2, seed=0, device="cpu")
    t0 = time.perf_counter()
    pol.load_plane("int8g64", old)
    full_s = time.perf_counter() - t0
    parts = {"other": lambda k: ".layers." not in k, "dense_layer": lambda k: ".layers.0." in k,
             "moe_layer_rest": lambda k: ".layers.1." in k and ".experts." not in k,
             "moe_layer_experts": lambda k: ".layers.1.feed_forward.experts." in k}

    def timed(sub: dict) -> tuple[float, float, dict]:
        """The medians of SWAP_REPS preparations (the follower's thread) and writes (the pause) of `sub`;
        each write writes the same values."""
        prep, runs = [], []
        for _ in range(SWAP_REPS):
            t0 = time.perf_counter()
            writes = pol.prepare_patch("int8g64", new, sub)
            prep.append(time.perf_counter() - t0)
        for _ in range(SWAP_REPS):
            t0 = time.perf_counter()
            wrote = pol.write_patch(writes)
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs), statistics.median(prep), wrote

    # a write's fixed cost (the model's parameter list, a sync) is paid once a version, not once a part:
    # timed alone with nothing to write, taken out of each part and added back once, scaled by the layers
    fixed_s, _, _ = timed({})
    per = {}
    for part, pick in parts.items():
        seconds, prep_s, wrote = timed({k: v for k, v in changes.items() if pick(k)})
        per[part] = {"seconds": round(seconds, 5), "net_seconds": round(max(seconds - fixed_s, 0.0), 5),
                     "prepare_seconds": round(prep_s, 5), **wrote,
                     "plane_bytes": int(sum(v.nbytes for k, v in new.items() if pick(k)))}
    moe = LAYERS - DENSE_LAYERS
    scale = {"other": VOCAB / VOCAB_BUILT, "dense_layer": DENSE_LAYERS, "moe_layer_rest": moe, "moe_layer_experts": moe * EXPERTS / BUILT}
    est = {k: round(sum(per[p][k] * m for p, m in scale.items()), 3)
           for k in ("net_seconds", "prepare_seconds", "bytes", "plane_bytes")}
    est["fixed_seconds"] = round(fixed_s * LAYERS / 2, 4)  # the built model has 2 of the 24 layers
    est["seconds"] = round(est.pop("net_seconds") + est["fixed_seconds"], 3)
    est["seconds_with_fixed_cost_per_part"] = round(sum(per[p]["seconds"] * m for p, m in scale.items()), 3)
    built = sum(p["plane_bytes"] for p in per.values())
    full_est = round(full_s * est["plane_bytes"] / built, 2)
    # the reconstructor's apply_patch copies and hashes every tensor of the plane (the contract's digest is
    # over whole tensors): it scales with the plane, not with the patch
    apply_est = round(apply_s * est["plane_bytes"] / built, 2)
    res = {"worker": worker, "reps": SWAP_REPS, "fixed_seconds_built": round(fixed_s, 5), "expert_names": "fused (transformers)" if fused else "per-expert (the learner's)",
           "patch_bytes": len(patch), "changed_elements": int(sum(len(v) for v in changes.values())),
           "plane_elements": int(sum(v.size for v in new.values())), "parts": per,
           "scaled_to_8b_a1b": {**est, "layers": f"embedding of {VOCAB} rows ({VOCAB_BUILT} built) + {DENSE_LAYERS} dense + {moe} MoE layers of {EXPERTS} experts ({BUILT} built)",
                                "full_load_seconds_before": full_est, "apply_patch_seconds": apply_est,
                                # without the follower's thread the worker applies, prepares and writes in line
                                "pause_seconds": round(est["seconds"] + est["prepare_seconds"] + apply_est, 2),
                                # the thread (worker/follower.py) applies the patch and prepares the writes
                                # beside sampling: the pause is the writes
                                "background_seconds": round(apply_est + est["prepare_seconds"], 2),
                                "pause_seconds_with_background_follower": est["seconds"]},
           "measured_full_load_seconds": round(full_s, 2),
           "publisher_plane_s": round(plane_s, 2), "publisher_encode_s": round(encode_s, 2),
           "worker_apply_patch_s": round(apply_s, 2)}
    print(res, flush=True)
    return res


def _rss() -> int:
    """This process's peak RSS so far. Linux: VmHWM, the peak of this process image alone (ru_maxrss there
    starts an exec'd child at its parent's peak); elsewhere ru_maxrss (bytes on macOS)."""
    import resource

    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_worker(d: str, n: int, budget: int, dtype: str) -> dict:
    """The worker's side in a process of its own (its peak RSS is then the worker's alone): the anchor plane read
    from `d` (as a joining worker downloads it), the MLX model built and loaded, the patch applied (the
    reconstructor's old and new plane both alive) and loaded, then one psqa group of n."""
    import pickle

    import mlx.core as mx

    from worker_contract.pulse import apply_patch
    from worker_contract.worker.memory import worker_memory
    from worker_contract.worker.mlx_model import MlxPolicy

    started = _rss()  # Python, numpy, MLX and our modules imported
    with open(Path(d) / "plane.pkl", "rb") as f:  # pickle keeps ml_dtypes' bfloat16, which .npz does not
        old = pickle.load(f)
    patch = (Path(d) / "patch.bin").read_bytes()
    pol = MlxPolicy(d, plane="int8g64", seed=0, dtype=dtype)
    est = worker_memory(pol.model, pol.config, plane="int8g64", dtype=dtype, n_samples=n, max_new_tokens=budget)
    pol.load_plane("int8g64", old)
    joined = _rss()
    changes: dict = {}
    new = apply_patch(old, patch, changes_out=changes)
    pol.load_plane("int8g64", new, changes)
    del old
    followed = _rss()
    prompt = pol.chat.encode("Question: the dmd gene is " * 40)
    pol.sample_episode_groups([prompt], n, temperature=1.0, top_p=1.0, max_new_tokens=budget,
                              search=lambda q: "Doc 1 the dmd gene")
    return {"rss_peak_after_imports": started, "rss_peak_after_join": joined, "rss_peak_after_follow": followed,
            "rss_peak_after_psqa_group": _rss(),
            "mlx_peak_memory": int(mx.get_peak_memory()) if hasattr(mx, "get_peak_memory") else None,
            "estimate": est}


def memory(n: int, budget: int, dtype: str = "bfloat16") -> dict:
    """The MLX worker's peak RSS at 8B-A1B shapes, layer-scaled (1 dense + 1 MoE layer), through a join, a
    patch followed and one psqa group (`memory_worker`, in a process of its own), against the estimate
    worker/memory.py refuses by for the same compute dtype; then the estimate at the full 24 layers.
    `dtype` float32 on an x86 CPU, whose MLX multiplies bf16 by int8 codes ten times slower: its scales,
    biases and activations are then twice a Mac's, so the figure is an upper bound of the bf16 one."""
    import json
    import pickle
    import subprocess

    from worker_contract.planes import get_plane
    from worker_contract.pulse import encode_patch
    from worker_contract.worker.memory import OVERHEAD_BYTES, PROMPT_TOKENS, kv_bytes

    plane = get_plane("int8g64")
    old_hf, new_hf = _two_versions(_hf_shapes(False, 1, 1))
    old = plane.from_hf(old_hf)
    code = ("import json, sys; from bench.worker_speed import memory_worker; "
            "print(json.dumps(memory_worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))")
    with tempfile.TemporaryDirectory(prefix="worker-speed-mem-") as tmp:  # the plane's pickle: not left behind
        d = Path(tmp)
        _config(d, False)
        with open(d / "plane.pkl", "wb") as f:
            pickle.dump(old, f, protocol=5)
        (d / "patch.bin").write_bytes(encode_patch(old, plane.from_hf(new_hf)))
        del old_hf, new_hf
        out = subprocess.run([sys.executable, "-c", code, str(d), str(n), str(budget), dtype], check=True,
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent).stdout
        cfg = json.loads((d / "config.json").read_text())
    worker = json.loads(out.strip().splitlines()[-1])
    plane_bytes = sum(a.nbytes for a in old.values())
    full_cfg = dict(cfg, num_hidden_layers=LAYERS,
                    layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(LAYERS)])
    per_moe = sum(a.nbytes * (EXPERTS / BUILT if ".experts." in k else 1) for k, a in old.items() if ".layers.1." in k)
    per_dense = sum(a.nbytes for k, a in old.items() if ".layers.0." in k)
    full_plane = int(sum(a.nbytes for k, a in old.items() if ".layers." not in k) * VOCAB / VOCAB_BUILT
                     + DENSE_LAYERS * per_dense
                     + (LAYERS - DENSE_LAYERS) * per_moe)
    full = {"weights": full_plane, "plane_copy": full_plane, "patch_result": full_plane,
            "kv_cache_recipe": kv_bytes(full_cfg, 8, 4096 + PROMPT_TOKENS, "bfloat16"), "overhead": OVERHEAD_BYTES}
    full["total"] = sum(full.values())
    res = {"layer_scaled": {**worker, "plane_bytes": plane_bytes,
                            "measured_over_estimate": round(worker["rss_peak_after_psqa_group"]
                                                            / worker["estimate"]["total"], 3)},
           "full_24_layers_estimate": {k: round(v / 1e9, 2) for k, v in full.items()},
           "how": "The worker's side runs in a process of its own (bench.worker_speed.memory_worker); its RSS "
                  "high-water mark (VmHWM on Linux) after each stage is the worker's whole process: Python, MLX and "
                  "the imports included. The estimate is worker/memory.py's for the same shapes and dtype. The "
                  "24-layer figure is the plane's bytes from the shapes (exact) with the psqa recipe's KV cache "
                  "(8 rows of 4096 + 512 tokens, bf16) and the estimate's overhead."}
    print(res, flush=True)
    return res


# -- start ----------------------------------------------------------------------------------------------
#: what a fresh process times (imports included): the torch worker's model as the worker builds it, and the same
#: model with transformers' random init, which the worker skips (load() overwrites every weight before a sample)
_START = {
    "worker": "from worker_contract.worker.model import PolicyModel; PolicyModel(d, threads=2, device='cpu')",
    "random_init": "import torch; from transformers import AutoConfig, AutoModelForCausalLM; torch.set_num_threads(2); "
                   "AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=torch.float32)",
}


def start(layers: int, runs: int, tiny: bool = False) -> dict:
    from bench.lfm2_loop import build_model
    from bench.startup import time_process

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", layers, tiny, "cpu")
        walls: dict[str, list[float]] = {k: [] for k in _START}
        for _ in range(runs):  # in turn, so that the machine's drift falls on both
            for name, code in _START.items():
                argv = [sys.executable, "-c", f"import sys; d = sys.argv[1]; {code}", model["path"]]
                walls[name].append(round(time_process(argv), 3))
    res = {"model": {"layers": layers, "params": model["params"], "tiny": tiny, "shapes_of": "LiquidAI/LFM2.5-8B-A1B"},
           "runs": runs, "wall_s": walls, "wall_s_median": {k: statistics.median(v) for k, v in walls.items()},
           "note": "each a fresh process, its imports included (python -c pass is about 0.05 s; torch and "
                   "transformers about 6 s here); float32 on the CPU, 2 threads"}
    res["worker_over_random_init"] = round(res["wall_s_median"]["worker"] / res["wall_s_median"]["random_init"], 3)
    print(res, flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    global HIDDEN, VOCAB, EXPERTS, MOE_I, DENSE_I, BUILT, VOCAB_BUILT
    from worker_contract.cli import number

    p = argparse.ArgumentParser(prog="python -m bench.worker_speed", description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["decode", "swap", "memory", "start"], help="what to measure")
    p.add_argument("--groups", type=number(int, at_least=1), default=2, help="decode: prompts (groups) in one batch")
    p.add_argument("--n", type=number(int, at_least=1), default=8, help="decode: samples a group")
    p.add_argument("--budget", type=number(int, at_least=1), default=160,
                   help="decode: max new tokens (sampled and tool)")
    p.add_argument("--worker", choices=["mlx", "torch"], default="mlx", help="swap: which worker")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="decode: the torch worker's device")
    p.add_argument("--workers", nargs="+", choices=["torch", "mlx"], default=["torch", "mlx"],
                   help="decode: which workers to measure (a CUDA box: torch)")
    p.add_argument("--experts-built", type=number(int, at_least=1, at_most=EXPERTS), default=4,
                   help=f"swap/memory: experts built per MoE layer (of the {EXPERTS})")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="memory: the MLX worker's compute dtype (float32 on an x86 CPU: an upper bound, far faster)")
    p.add_argument("--layers", type=number(int, at_least=1, at_most=LAYERS), default=2,
                   help="start: layers of the 8B model's shapes (2: 0.56 B parameters)")
    p.add_argument("--runs", type=number(int, at_least=1), default=3, help="start: processes of each kind, in turn")
    p.add_argument("--tiny", action="store_true", help="swap/memory: hidden 128, vocab 256, 4 experts; start: "
                   "bench.lfm2_step's tiny shape (a CI run)")
    p.add_argument("--out", default=None, help="result file (default bench/results/worker_speed_<part>.json)")
    a = p.parse_args(argv)
    if a.tiny and a.experts_built > 4:
        p.error(f"--experts-built {a.experts_built} with --tiny: the tiny model has 4 experts a layer; give at most 4")
    from bench.common import write_result

    BUILT = a.experts_built
    if a.tiny:
        HIDDEN, VOCAB, EXPERTS, MOE_I, DENSE_I, VOCAB_BUILT = 128, 256, 4, 64, 256, 256
    if a.part == "decode":
        result = {"settings": {"groups": a.groups, "n": a.n, "max_new_tokens": a.budget, "device": a.device,
                                "workers": a.workers}, **decode(a.groups, a.n, a.budget, a.device, tuple(a.workers))}
    elif a.part == "start":
        result = start(a.layers, a.runs, a.tiny)
    elif a.part == "memory":
        result = {"settings": {"n": a.n, "max_new_tokens": a.budget, "dtype": a.dtype},
                  **memory(a.n, a.budget, a.dtype)}
    else:
        result = swap(a.worker)
    name = f"worker_speed_{a.part}" + (f"_{a.worker}" if a.part == "swap" else "")
    print(write_result(name, result, path=a.out, argv=argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
