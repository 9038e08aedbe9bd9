"""GPU scale: megatron-core vs transformers for a Qwen2.5-1.5B-shaped model on one GPU.

    python -m bench.megatron_gpu                      # parity + learner step, all backends
    python -m bench.megatron_gpu --parts step --variants megatron
    python -m bench.megatron_gpu --tiny --device cpu  # a smoke run (needs megatron's CPU shims installed)
    python -m bench.megatron_gpu --arch llama          # Llama-3.2-1B shapes with its llama3 rope scaling
More in docs/performance.md (module notes).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from worker_contract.cli import number

REPO = Path(__file__).resolve().parent.parent
ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_parameters=ROPE, rms_norm_eps=1e-6, tie_word_embeddings=True)
#: Llama-3.2-1B's shapes and rope (llama3 scaling, factor 32)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                  rope_parameters=LLAMA3_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=True)
VARIANTS = ("megatron", "megatron-unfused", "megatron-graphs", "megatron-local", "megatron-compiled", "hf")
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rope_parameters=ROPE, rms_norm_eps=1e-6,
            tie_word_embeddings=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.megatron_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="parity,wgrad,step", help="comma list of: parity, wgrad, step, graphs "
                   "(CUDA graphs vs eager on ragged batches), tp2 (needs 2 GPUs)")
    p.add_argument("--variants", default="megatron,hf,megatron@8,megatron-graphs@8,megatron-unfused@8,hf@8,"
                   "megatron-graphs",
                   help="learner-step backends, each with the recipe's micro-batches (compute.max_tokens_per_gpu) "
                   "or @N for N rows each: megatron (sdpa spec, float32 "
                   "weight-gradient accumulation in the GEMM where torch can), megatron-unfused (the same, "
                   "accumulating separately), megatron-graphs (compute.cuda_graphs on), megatron-local (stock "
                   "local spec), megatron-compiled "
                   "(experimental: torch.compile per layer), hf")
    p.add_argument("--steps", type=number(int, at_least=1), default=3, help="timed steps per variant (after 2 warm-up steps)")
    p.add_argument("--rows", type=number(int, at_least=1), default=64)
    p.add_argument("--prompt", type=number(int, at_least=1), default=128)
    p.add_argument("--response", type=number(int, at_least=1), default=384)
    p.add_argument("--micro-batch", type=number(int, at_least=1), default=8, help="rows per micro-batch of the graphs and tp2 parts")
    p.add_argument("--tiny", action="store_true", help="tiny model and batch (smoke run)")
    p.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2",
                   help="qwen2: Qwen2.5-1.5B shapes; llama: Llama-3.2-1B shapes with llama3 rope scaling")
    p.add_argument("--profile", action="store_true", help="profile one extra megatron step (kernel table beside --out)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--commit", default=None,
                   help="the commit of a tree without git (a `git archive` of an older commit, for a paired run); "
                        "default: the tree's own provenance (git, or STOA_COMMIT where it was copied without .git)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "megatron_gpu.json"))
    return p


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("megatron-core", "torch", "transformers", "transformer-engine"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def cuda_ms(fn, reps: int, warmup: int = 3) -> float:
    """Mean milliseconds of `fn()` on the GPU (CUDA events around `reps` calls, after `warmup`)."""
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def matmul_tflops(device: str, n: int = 8192, reps: int = 10) -> float:
    import torch

    if device != "cuda":
        return float("nan")
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / (cuda_ms(lambda: a @ b, reps) / 1e3) / 1e12


def attempt(label: str, fn, *args) -> dict:
    """fn(*args), or {"error": ...} with the traceback printed: one failing part must not lose the others."""
    try:
        out = fn(*args)
    except Exception as e:
        import traceback

        traceback.print_exc()
        out = {"error": f"{type(e).__name__}: {e}"}
    print(label, json.dumps(out), flush=True)
    return out


def make_model_dir(shape: dict, device: str, out: Path, arch: str = "qwen2"):
    """A random Qwen2 or Llama (norms and biases randomised too) saved as bf16 HF safetensors + a tokenizer."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(arch, **shape)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
    # cast a copy of the weights, not the model: `model.to(bf16)` would also round the rotary inv_freq
    # buffer to bf16 (0.4% error, radians of phase at position 500)
    model.save_pretrained(out, state_dict={k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(out / "tokenizer.json"))
    return model


def _capture(store: list):
    def hook(_module, _inputs, output):
        store.append(output[0] if isinstance(output, tuple) else output)

    return hook


def parity(hf_model, model_dir: Path, device: str, batch: int, seq: int) -> dict:
    import torch

    from trainer.models import get_architecture, load_hf_config
    from trainer.models.model import build_model, load_full_state

    cfg = load_hf_config(model_dir)
    arch = get_architecture(cfg)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), device=device, generator=None)
    pos = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    out = {"rope_theta_in_config": cfg.get("rope_parameters"), "config_rope_theta_top": cfg.get("rope_theta")}
    inv_freq = hf_model.model.rotary_emb.inv_freq.clone()
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf_model.to(dtype)
        hf_model.model.rotary_emb.inv_freq = inv_freq  # keep rope float32 (megatron does; .to() rounds it)
        src = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight" or not cfg["tie_word_embeddings"]}
        mg = build_model(cfg, dtype=dtype, attention="sdpa", device=device, init=False).eval()
        load_full_state(mg, arch.hf_to_megatron(src, cfg, cfg["vocab_size"]))
        layers: dict[str, list] = {"hf": [], "mg": []}
        hooks = [m.register_forward_hook(_capture(layers[k]))
                 for k, mods in (("hf", hf_model.model.layers), ("mg", mg.decoder.layers)) for m in mods]
        with torch.no_grad():
            ref = hf_model(ids).logits.float()
            got = mg(ids, pos, None).float()
        for h in hooks:
            h.remove()
        inv_hf = hf_model.model.rotary_emb.inv_freq.float()
        inv_mg = mg.rotary_pos_emb.inv_freq.float().to(inv_hf.device)
        out[f"{name}_diagnostics"] = {
            "inv_freq_max_rel_diff": ((inv_hf - inv_mg).abs() / inv_hf.abs()).max().item(),
            "layer_rel_l2": [((b.transpose(0, 1).float() - a.float()).norm() / a.float().norm()).item()
                             for a, b in zip(layers["hf"], layers["mg"], strict=False)][:: max(1, len(layers["hf"]) // 7)],
        }
        del layers
        diff = (got - ref).abs()
        spread = ref.std().item()
        out[name] = {
            "rel_l2": ((got - ref).norm() / ref.norm()).item(),
            "max_abs": diff.max().item(), "mean_abs": diff.mean().item(), "logit_std": spread,
            "max_abs_over_std": diff.max().item() / spread, "mean_abs_over_std": diff.mean().item() / spread,
            "top1_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        }
        del mg, ref, got, diff
        gc.collect()
    return out


def backend_parity(model_dir: Path, device: str, rows: int, prompt: int, response: int) -> dict:
    """The backend's own forward path (fused rope in our SDPA attention, vocab-parallel log-probs) against
    transformers' float32 log_softmax, on the response tokens of a batch, for float32 and bf16 models."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.backends.megatron import MegatronBackend
    from trainer.config import resolve

    cfg = resolve("gsm8k", env={}, overrides={"compute.micro_batch_size": 8})
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    batch = synthetic_batch(rows, prompt, response, hf.config.vocab_size, seed=1)
    ids = batch.input_ids.to(device)
    with torch.no_grad():
        logits = hf(ids).logits[:, prompt - 1 : -1].float() / cfg.algo.temperature
        ref = torch.log_softmax(logits, -1).gather(-1, ids[:, prompt:, None]).squeeze(-1).cpu()
    del hf, logits
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        be = MegatronBackend.load(model_dir, cfg, device=device, compute_dtype=dtype)
        diff = (be.logprobs(batch).cpu() - ref).abs()
        out[name] = {"logp_max_abs_diff": diff.max().item(), "logp_mean_abs_diff": diff.mean().item()}
        del be
        gc.collect()
        torch.cuda.empty_cache() if device == "cuda" else None
    return out


def synthetic_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
    import torch

    from trainer.step import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, prompt + response), generator=g)
    mask = torch.ones(rows, response)
    return TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_lens=torch.full((rows,), prompt),
                      response_lens=torch.full((rows,), response), loss_mask=mask,
                      behavior_logp=-torch.rand(rows, response, generator=g) * 3,
                      advantages=torch.randn(rows, generator=g), rewards=torch.zeros(rows))


def ragged_batch(rows: int, max_prompt: int, max_response: int, vocab: int, seed: int = 0):
    """Rows of random prompt and response lengths, right-padded, as a real step's batch is."""
    import torch

    from trainer.step import TrainBatch

    g = torch.Generator().manual_seed(seed)
    p = torch.randint(max_prompt // 4, max_prompt + 1, (rows,), generator=g)
    r = torch.randint(max_response // 4, max_response + 1, (rows,), generator=g)
    width, resp = int((p + r).max()), int(r.max())
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    live = torch.arange(width)[None, :] < (p + r)[:, None]
    mask = (torch.arange(resp)[None, :] < r[:, None]).float()
    return TrainBatch(input_ids=ids * live, attention_mask=live.long(), prompt_lens=p, response_lens=r,
                      loss_mask=mask, behavior_logp=-torch.rand(rows, resp, generator=g) * 3 * mask,
                      advantages=torch.randn(rows, generator=g), rewards=torch.zeros(rows))


def graphs_check(model_dir: Path, args) -> dict:
    """compute.cuda_graphs on ragged batches (several micro-batch shapes, so several graphs sharing one pool):
    three steps from the same weights, against the same padded calls run eagerly (which must agree to the
    bit: a replay that read or wrote the wrong memory would not) and against the unpadded eager path
    (which differs by bf16 rounding where padding changes a GEMM's shape, and so its reduction)."""
    import torch

    from trainer.backends.megatron import MegatronBackend
    from trainer.config import resolve
    from trainer.objectives import policy_loss

    cfg = resolve("gsm8k", env={}, overrides={"compute.micro_batch_size": args.micro_batch, "model.dtype": "bfloat16"})
    cfg.compute.max_tokens_per_gpu = None
    runs = {}
    for mode in ("eager", "padded", "graphs"):
        be = MegatronBackend.load(model_dir, cfg, device=args.device, cuda_graphs=mode != "eager")
        if mode == "padded":
            be._local.graphs.capture = False  # the same padded decoder calls, without capturing them
        metrics = []
        for step in range(3):
            batch = ragged_batch(args.rows, args.prompt, args.response, be.vocab_size, seed=step)
            batch.ref_logp = be.logprobs(batch, reference=True)
            metrics.append(be.train_step(batch, lambda lp, mb: policy_loss(
                lp, mb.behavior_logp, mb.ref_logp, mb.advantages, mb.loss_mask, cfg.algo)))
        probe = ragged_batch(args.rows, args.prompt, args.response, be.vocab_size, seed=99)
        state = be._local.graphs
        runs[mode] = {"metrics": metrics, "logp": be.logprobs(probe).cpu(), "mask": probe.loss_mask,
                        "shapes": sorted(state.calls) if state else None, "failed": state.failed if state else None}
        del be
        gc.collect()
        torch.cuda.empty_cache()
    out = {"shapes": runs["graphs"]["shapes"], "failed": runs["graphs"]["failed"],
           "loss": {k: [m["loss"] for m in r["metrics"]] for k, r in runs.items()},
           "grad_norm": {k: [m["grad_norm"] for m in r["metrics"]] for k, r in runs.items()}}
    for other in ("padded", "eager"):
        diff = (runs[other]["logp"] - runs["graphs"]["logp"]).abs()[runs["graphs"]["mask"] > 0]
        out[f"logp_after_vs_{other}"] = {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(),
                                          "bit_equal": bool(torch.equal(runs[other]["logp"], runs["graphs"]["logp"]))}
    return out


def _profile_step(backend, batch, fn, out: Path, device: str) -> None:
    """One step under torch.profiler: where the GPU time goes, and how busy the GPU was."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        batch.ref_logp = backend.logprobs(batch, reference=True)
        backend.train_step(batch, fn)
        _sync(device)
    events = prof.key_averages()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    try:
        table = events.table(sort_by=key, row_limit=40)
    except Exception:  # older profiler naming
        table = events.table(sort_by="self_cuda_time_total", row_limit=40)
    out.write_text(table)
    print("\n".join(table.splitlines()[:28]), flush=True)
    del torch


def wgrad_accumulation(device: str, tokens: int = 4096, n_in: int = 1536, n_out: int = 8960, reps: int = 20) -> dict:
    """One weight-gradient GEMM [n_out, n_in] over `tokens`, accumulated into float32: inside the GEMM vs
    a bf16 GEMM then a separate float32 add (CUDA events, mean of `reps`)."""
    import torch

    from trainer.models.fused_linear import accumulate_wgrad, fused_wgrad_available

    out = {"fused_available": fused_wgrad_available(device), "shape": [tokens, n_in, n_out]}
    if device != "cuda":
        return out
    g = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(n_out, n_in, device="cuda")

    out["unfused_ms"] = cuda_ms(lambda: acc.add_(g.t() @ x), reps)
    if out["fused_available"]:
        out["fused_ms"] = cuda_ms(lambda: accumulate_wgrad(acc, g, x, fused=True), reps)
    return out


def _graphs_state(backend) -> dict | None:
    graphs = getattr(getattr(backend, "_local", None), "graphs", None)
    return None if graphs is None else {"shapes": sorted(graphs.calls), "failed": graphs.failed}


def learner_step(variant: str, model_dir: Path, args, n_params: int, rate: float) -> dict:
    import torch

    from trainer.backends.base import micro_batches
    from trainer.config import resolve
    from trainer.objectives import policy_loss

    name, _, mb = variant.partition("@")
    if name not in VARIANTS:
        raise ValueError(f"variant {variant!r}: known are {', '.join(VARIANTS)}, each optionally @<rows>")
    overrides = {"model.dtype": "bfloat16" if args.device == "cuda" else "float32"}
    if mb:
        overrides["compute.micro_batch_size"] = int(mb)
    elif args.tiny:
        overrides["compute.max_tokens_per_gpu"] = 4 * (args.prompt + args.response)
    cfg = resolve("gsm8k", env={}, overrides=overrides)
    if mb:
        cfg.compute.max_tokens_per_gpu = None  # rows alone
    algo = cfg.algo
    if name.startswith("megatron"):
        from trainer.backends.megatron import MegatronBackend

        backend = MegatronBackend.load(model_dir, cfg, device=args.device,
                                       attention="local" if name == "megatron-local" else "auto",
                                       compile_layers=name == "megatron-compiled",
                                       fused_wgrad=False if name in ("megatron-unfused", "megatron-local") else None,
                                       cuda_graphs=name == "megatron-graphs")
    else:
        from trainer.backends.hf import HFBackend

        backend = HFBackend.load(model_dir, cfg, device=args.device)
    batch = synthetic_batch(args.rows, args.prompt, args.response, backend.vocab_size)

    def fn(lp, mb):
        return policy_loss(lp, mb.behavior_logp, mb.ref_logp, mb.advantages, mb.loss_mask, algo)

    times, ref_times = [], []
    for i in range(2 + args.steps):
        _sync(args.device)
        t0 = time.perf_counter()
        batch.ref_logp = backend.logprobs(batch, reference=True)
        _sync(args.device)
        t1 = time.perf_counter()
        metrics = backend.train_step(batch, fn)
        _sync(args.device)
        t2 = time.perf_counter()
        print(f"  {variant} step {i}: ref {t1 - t0:.3f}s train {t2 - t1:.3f}s loss {metrics['loss']:.4g}", flush=True)
        if i >= 2:
            times.append(t2 - t0)
            ref_times.append(t1 - t0)
    if args.profile and variant == "megatron":  # the recipe's micro-batch
        _profile_step(backend, batch, fn, Path(args.out).with_name("megatron_profile.txt"), args.device)
    tokens = args.rows * (args.prompt + args.response)
    step = statistics.median(times)
    chunks = micro_batches(batch, cfg.compute)
    res = {"micro_batches": len(chunks), "rows_per_micro_batch": chunks[0].rows,
           "max_tokens_per_gpu": cfg.compute.max_tokens_per_gpu, "cuda_graphs": _graphs_state(backend),
           "fused_wgrad": bool(getattr(getattr(backend, "_local", None), "fused_wgrad", False)),
           "step_s": step, "ref_forward_s": statistics.median(ref_times), "steps_s": times,
           "tokens": tokens, "tokens_per_s": tokens / step, "mfu": 8 * n_params * tokens / step / (rate * 1e12),
           "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
    if args.device == "cuda":
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    if hasattr(backend, "shutdown"):
        backend.shutdown()
    del backend
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return res


def _tp2_rank(rank: int, port: int, model_dir: str, args, out: str) -> None:
    import torch

    from trainer.backends.megatron import init_parallel
    from trainer.backends.megatron_rank import MegatronRank
    from trainer.config import resolve
    from trainer.objectives import policy_loss

    dev = torch.device("cuda", rank)
    init_parallel(rank, 2, dev, port=port)
    cfg = resolve("gsm8k", env={}, overrides={"compute.micro_batch_size": args.micro_batch, "compute.tensor_parallel": 2})
    r = MegatronRank(model_dir, cfg, device=dev)
    batch = synthetic_batch(args.rows, args.prompt, args.response, r.identity.vocab_size)
    logp = r.logprobs(batch).cpu()
    times = []
    for _ in range(2 + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch.ref_logp = r.logprobs(batch, reference=True)
        r.train_step(batch, lambda lp, mb: policy_loss(lp, mb.behavior_logp, mb.ref_logp, mb.advantages,
                                                       mb.loss_mask, cfg.algo))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        torch.save({"logp": logp, "times": times[2:], "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}, out)


def tp2(model_dir: Path, args, n_params: int, rate: float) -> dict:
    """Tensor-parallel 2 (two processes, NCCL) against TP 1 on the same batch: log-probs and step time."""
    import torch

    from trainer.backends.megatron import MegatronBackend, _free_port
    from trainer.config import resolve

    cfg = resolve("gsm8k", env={}, overrides={"compute.micro_batch_size": args.micro_batch})
    one = MegatronBackend.load(model_dir, cfg, device="cuda")
    batch = synthetic_batch(args.rows, args.prompt, args.response, one.vocab_size)
    ref = one.logprobs(batch).cpu()
    del one
    gc.collect()
    torch.cuda.empty_cache()
    out = Path(model_dir).parent / "tp2.pt"
    torch.multiprocessing.spawn(_tp2_rank, args=(_free_port(), str(model_dir), args, str(out)), nprocs=2)
    got = torch.load(out, weights_only=False)
    diff = (got["logp"] - ref).abs()
    step = statistics.median(got["times"])
    tokens = args.rows * (args.prompt + args.response)
    return {"logp_max_abs_diff_vs_tp1": diff.max().item(), "logp_mean_abs_diff_vs_tp1": diff.mean().item(),
            "step_s": step, "steps_s": got["times"], "tokens_per_s": tokens / step,
            "mfu_per_gpu": 8 * n_params * tokens / step / (2 * rate * 1e12), "peak_mem_gib_rank0": got["peak_mem_gib"]}


def run(args, save) -> dict:
    import torch

    from trainer.backends.megatron import init_parallel

    shape = TINY if args.tiny else QWEN25_15B
    if args.arch == "llama":
        shape = {**TINY, "rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 16}} if args.tiny else LLAMA32_1B
    result: dict = {"versions": _versions(), "arch": args.arch, "shape": shape, "config": {k: getattr(args, k) for k in ("rows", "prompt", "response",
                                                                             "micro_batch", "steps", "device")}}
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32
    rate = matmul_tflops(args.device)
    result["matmul_bf16_tflops"] = rate
    print(f"bf16 matmul: {rate:.1f} TFLOP/s", flush=True)
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    init_parallel(0, 1, dev)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.arch
        hf_model = make_model_dir(shape, args.device, model_dir, args.arch)
        n_params = sum(p.numel() for p in hf_model.parameters())  # tied embedding counted once
        result["params"] = n_params
        if "parity" in args.parts:
            result["parity"] = parity(hf_model, model_dir, args.device, 4 if not args.tiny else 2,
                                      512 if not args.tiny else 32)
            print(json.dumps(result["parity"], indent=1), flush=True)
            save(result)
            result["parity_backend_logprobs"] = attempt("backend log-probs vs HF fp32", backend_parity, model_dir,
                                                        args.device, 8 if not args.tiny else 2, args.prompt,
                                                        args.response)
            save(result)
        del hf_model
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if "wgrad" in args.parts:
            result["wgrad"] = wgrad_accumulation(args.device)
            print("wgrad", json.dumps(result["wgrad"]), flush=True)
            save(result)
        if "graphs" in args.parts:
            result["graphs_check"] = attempt("graphs_check", graphs_check, model_dir, args)
            save(result)
        if "step" in args.parts:
            result["step"] = {}
            for variant in args.variants.split(","):
                result["step"][variant] = attempt(variant, learner_step, variant, model_dir, args, n_params, rate)
                save(result)
        if "tp2" in args.parts:
            result["tp2"] = attempt("tp2", tp2, model_dir, args, n_params, rate)
    return result


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.tiny:
        args.rows, args.prompt, args.response, args.micro_batch = 8, 8, 24, 4
    sys.path.insert(0, str(REPO))
    from bench.common import write_result

    named = {"commit": args.commit} if args.commit else {}  # else write_result's provenance names it

    def save(result: dict) -> Path:  # after every part, so a run cut short keeps what it measured
        from trainer.backends import vocab_parallel

        return write_result("megatron_gpu", {**result, "features": dict(vocab_parallel.FEATURES), **named},
                            args.out, argv, "bench.megatron_gpu")

    result = run(args, save)
    path = save(result)
    summary = {v: {k: round(r[k], 4) for k in ("step_s", "tokens_per_s", "mfu") if k in r}
               for v, r in result.get("step", {}).items()}
    print(f"wrote {path}\n{json.dumps(summary, indent=1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
