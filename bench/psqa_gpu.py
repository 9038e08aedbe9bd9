"""The PaperSearchQA loop on one GPU box: the embedded psqa run (embedded/run.py) with a larger model.

    python -m bench.psqa_gpu [--rl-seconds 300] [--workers 4] [--backends megatron,hf] [--out ...json]
    python -m bench.psqa_gpu --tiny --device cpu --backends megatron,hf   # smoke (megatron: DRL_MEGATRON_CPU_SETUP)

Builds the generated data, supervises an LFM2-MoE of tens of millions of parameters on the GPU into the search
format against the real retriever service, then runs `run_embedded` on it as MODEL= (native engine, GPU workers)
once per backend of --backends, same base and seed, and measures held-out cover-EM (first, last, mean of the
last three, best), learner steps per hour and each worker's wait for the retriever. More in docs/performance.md
(the PaperSearchQA loop on one GPU).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from worker_contract.cli import number

from .common import RESULTS, command, machine_info, provenance

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / ".stoa" / "psqa_gpu"
#: a worker's last line (worker_contract/worker/loop.py, `run`)
_WAIT = re.compile(r"worker (\S+) stopping: (\d+) groups uploaded, last version v(\d+); (\d+) searches, ([\d.]+) s "
                   r"waiting for the retriever of ([\d.]+) s sampling")


def _log(msg: str) -> None:
    print(f"[psqa_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def base_config(args):
    from embedded.psqa_base import PsqaBaseConfig

    kinds = ("conv", "conv", "full_attention")
    return PsqaBaseConfig(
        hidden_size=args.width, layer_types=tuple(kinds[i % 3] for i in range(args.layers)),
        num_heads=max(1, args.width // 64), num_kv_heads=max(1, args.width // 256), intermediate_size=args.width * 3,
        num_experts=args.experts, experts_per_token=2, moe_intermediate_size=args.width, sft_steps=args.sft_steps,
        short_steps=args.sft_steps * 3 // 4, sft_lr=args.sft_lr, sft_batch_size=32,
        eval_questions=10 if args.tiny else 100)


def build_base(cfg, paths, args, root: Path = ROOT) -> tuple[Path, dict]:
    """The data, then the base on the GPU against a retriever of our own (stopped before the run starts its own)."""
    from embedded.psqa import ensure_data, free_port
    from embedded.psqa_base import ensure_psqa_base
    from infra.retriever import serve_argv
    from worker_contract.tasks.psqa_retrieval import RetrieverClient, RetrieverError, search_tool

    data = ensure_data(cfg, paths)
    port = free_port()
    log = open(root / "base-retriever.log", "w")
    proc = subprocess.Popen(serve_argv(data / "corpus.jsonl", port), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = RetrieverClient(f"http://127.0.0.1:{port}", timeout_s=5.0, retries=0)
        for _ in range(600):
            try:
                client.health()
                break
            except RetrieverError:
                if proc.poll() is not None:
                    raise RuntimeError(f"the retriever exited {proc.returncode}: see {log.name}") from None
                time.sleep(0.2)
        model_dir, report = ensure_psqa_base(data, paths.cache, search_tool(client, k=3, strict=True),
                                             cfg=base_config(args), log=_log, device=args.device)
    finally:
        proc.terminate()
        proc.wait(30)
    _log(f"base {model_dir}: {report.params / 1e6:.1f} M parameters, built in {report.build_seconds} s, cover-EM "
         f"{100 * report.pass1:.1f}% (T=1), greedy {100 * report.greedy_pass1:.1f}%, search rate "
         f"{100 * report.search_rate:.0f}%")
    return model_dir, report.model_dump(mode="json")


def worker_waits(run_dir: Path) -> list[dict]:
    """Each worker's last line: groups, searches, seconds waiting for the retriever and sampling."""
    out = []
    for path in sorted(run_dir.glob("worker-*.log")):
        lines = list(_WAIT.finditer(path.read_text(errors="replace")))
        if lines:  # the last session's line
            m = lines[-1]
            out.append({"worker": m[1], "groups": int(m[2]), "version": int(m[3]), "searches": int(m[4]),
                        "search_wait_s": float(m[5]), "sampling_s": float(m[6]),
                        "search_share_of_sampling": round(float(m[5]) / max(float(m[6]), 1e-9), 4)})
    return out


def summarize(rows: list[dict], waits: list[dict], rl_s: float) -> dict:
    evals = sorted((r for r in rows if "eval/accuracy" in r), key=lambda r: r["eval/version"])
    steps = [r for r in rows if "train/step_time_s" in r]
    acc = [e["eval/accuracy"] for e in evals]
    first = acc[0] if acc else None
    last3 = sum(acc[-3:]) / len(acc[-3:]) if acc else None
    span = (steps[-1]["time"] - steps[0]["time"]) if len(steps) > 1 and "time" in steps[0] else None
    wait = sum(w["search_wait_s"] for w in waits)
    return {
        "rl_seconds": round(rl_s, 1), "steps": steps[-1]["step"] if steps else 0,
        "learner_steps_per_hour": round(3600 * (len(steps) - 1) / span, 1) if span else None,
        "step_time_s_median": sorted(r["train/step_time_s"] for r in steps)[len(steps) // 2] if steps else None,
        "heldout_first": first, "heldout_last": acc[-1] if acc else None, "heldout_mean_last3": last3,
        "heldout_best": max(acc) if acc else None,
        "gain_last_points": None if first is None else round(100 * (acc[-1] - first), 2),
        "gain_mean_last3_points": None if first is None else round(100 * (last3 - first), 2),
        "gain_best_points": None if first is None else round(100 * (max(acc) - first), 2),
        "evals": [{k: e.get(k) for k in ("step", "eval/version", "eval/accuracy", "eval/search_rate",
                                          "eval/correct_after_search", "eval/seconds")} for e in evals],
        "workers": waits,
        "worker_search_wait_share_of_window": round(wait / (len(waits) * rl_s), 4) if waits and rl_s else None,
        "train_reward_first10": _mean([r.get("rollout/raw_reward") for r in steps[:10]]),
        "train_reward_last10": _mean([r.get("rollout/raw_reward") for r in steps[-10:]]),
    }


def _mean(xs) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return round(sum(xs) / len(xs), 5) if xs else None


#: the learner's precision and optimizer per backend (--backends): megatron runs the fleet recipe's plan (bf16
#: compute, float32 masters, bf16 Adam moments); hf keeps the embedded run's float32 throughout
BACKEND_OVERRIDES = {
    "megatron": {"train.backend": "megatron", "compute.dtype": "bfloat16", "optim.moment_dtype": "bfloat16"},
    "hf": {"train.backend": "hf", "compute.dtype": "float32", "optim.moment_dtype": "float32", "optim.offload": 0.0},
}
#: --tiny: the loop's every part at a size two CPU cores run in minutes (tests/test_psqa_megatron_loop.py)
TINY = {"width": 64, "layers": 3, "experts": 4, "sft_steps": 24, "eval_problems": 6, "eval_every": 2, "workers": 1}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.psqa_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rl-seconds", type=number(float, above=0), default=300.0, help="RL time budget (embedded.time_budget_s)")
    ap.add_argument("--backends", default="hf", help="comma-separated learner backends run one after the other on "
                    "the same base and seed (megatron,hf: the paired comparison)")
    ap.add_argument("--offload", type=number(float, at_least=0, at_most=1), default=0.0, help="optim.offload of the megatron run")
    ap.add_argument("--workers", type=number(int, at_least=1), default=4, help="reference workers, on the GPU")
    ap.add_argument("--width", type=number(int, at_least=1), default=512)
    ap.add_argument("--layers", type=number(int, at_least=1), default=6)
    ap.add_argument("--experts", type=number(int, at_least=1), default=8)
    ap.add_argument("--sft-steps", type=number(int, at_least=1), default=1200)
    ap.add_argument("--sft-lr", type=number(float, above=0), default=1e-3)
    ap.add_argument("--lr", type=number(float, above=0), default=None, help="RL learning rate (default: the recipe's)")
    ap.add_argument("--eval-every", type=number(int, at_least=1), default=5)
    ap.add_argument("--eval-problems", type=number(int, at_least=1), default=200)
    ap.add_argument("--groups-per-step", type=number(int, at_least=1), default=None, help="default: the recipe's embedded value")
    ap.add_argument("--max-steps", type=number(int, at_least=1), default=100000, help="learner steps of each run at most")
    ap.add_argument("--tiny", action="store_true", help="a smoke run of every part on the CPU (sizes: TINY)")
    ap.add_argument("--model", default=None, help="an LFM2-MoE HF directory to start from instead of building the "
                    "base (the CPU test's tiny model that writes the search tags)")
    ap.add_argument("--device", default="cuda", help="where the base is supervised; cpu only for a smoke run")
    ap.add_argument("--root", default=str(ROOT), help="data, bases, bucket and run dirs")
    ap.add_argument("--run", default=None, help="run id (default psqa-gpu-<time>); each backend's run adds -<backend>")
    ap.add_argument("--pair-with", default=None, help="an earlier result of this bench on the same base (another "
                    "backend, run in a separate call): its runs join this one's in the paired comparison")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=_setting,
                    help="a recipe override for the runs (dotted key, YAML value), e.g. algo.routing_replay=true; "
                    "repeat for more")
    ap.add_argument("--base-only", action="store_true", help="build (or find in the cache) the base, print its "
                    "directory on the last line and stop: other benches take it as --model")
    ap.add_argument("--out", default=str(RESULTS / "psqa_gpu.json"))
    return ap


def _setting(text: str) -> tuple[str, object]:
    import yaml

    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (a dotted recipe key, e.g. algo.routing_replay=true)")
    return key, yaml.safe_load(value)


def _run_backend(backend: str, over: dict, args, root: Path) -> tuple[int, float, list[dict], list[dict], dict]:
    """One embedded run on `backend`: (exit status, seconds, metrics rows, worker waits, the resolved recipe)."""
    from rich.console import Console

    from embedded.config import resolve_embedded
    from embedded.run import EmbeddedPaths, run_embedded

    over = {**over, **BACKEND_OVERRIDES[backend], "run": f"{over['run']}-{backend}"}
    if backend == "megatron":
        over["optim.offload"] = args.offload
    cfg = resolve_embedded("psqa", {}, over)  # MODEL=: the recipe's embedded.model_overrides, then ours
    paths = EmbeddedPaths(root, cfg.run)
    _log(f"{backend}: run {cfg.run}, compute {cfg.compute.dtype}, moments {cfg.optim.moment_dtype}")
    t0 = time.monotonic()
    rc = run_embedded(cfg, Console(width=140), root=root)
    rows = [json.loads(line) for line in paths.metrics.read_text().splitlines() if line.strip()] \
        if paths.metrics.exists() else []
    return rc, time.monotonic() - t0, rows, worker_waits(paths.run_dir), cfg.model_dump(mode="json")


def paired(runs: dict[str, dict]) -> dict | None:
    """Two backends on the same base and seed: their held-out curves side by side (by evaluation) and the gaps."""
    if len(runs) != 2:
        return None
    (a, ra), (b, rb) = runs.items()
    curves = [{"eval": i, **{f"{n}_{k}": (r["evals"][i] if i < len(r["evals"]) else {}).get(f"eval/{k}")
                             for n, r in ((a, ra), (b, rb)) for k in ("version", "accuracy")}}
              for i in range(max(len(ra["evals"]), len(rb["evals"])))]
    gap = {k: None if ra.get(k) is None or rb.get(k) is None else round(ra[k] - rb[k], 2)
           for k in ("gain_last_points", "gain_mean_last3_points", "learner_steps_per_hour")}
    return {"backends": [a, b], f"{a}_minus_{b}": gap, "curves": curves}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    backends = [b for b in args.backends.split(",") if b]
    if bad := [b for b in backends if b not in BACKEND_OVERRIDES]:
        print(f"error: --backends {args.backends}: {bad[0]!r} is not one of {', '.join(BACKEND_OVERRIDES)}",
              file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: bench.psqa_gpu needs a CUDA GPU (the base is supervised and the learner steps there); "
              "--tiny --device cpu runs a smoke run", file=sys.stderr)
        return 2
    from embedded.config import resolve_embedded
    from embedded.run import EmbeddedPaths

    root = Path(args.root)
    run = args.run or f"psqa-gpu-{int(time.time())}"
    over = {"run": run, "embedded.time_budget_s": args.rl_seconds, "embedded.max_steps": args.max_steps,
            "embedded.eval_every": args.eval_every, "embedded.eval_problems": args.eval_problems,
            "embedded.worker_backends": ["torch"] * args.workers}
    if args.tiny:
        over.update({"embedded.psqa.entities": 300, "embedded.psqa.heldout_entities": 30, "algo.groups_per_step": 2,
                     "algo.max_new_tokens": 48, "checkpoint.interval": 2})
    if args.base_only and args.model:
        print("error: --base-only builds the base; --model names one already", file=sys.stderr)
        return 2
    if args.lr is not None:
        over["optim.lr"] = args.lr
    if args.groups_per_step is not None:
        over["algo.groups_per_step"] = args.groups_per_step
    over.update(dict(args.set))
    try:  # a bad --set is said now, not after the base is built
        cfg = resolve_embedded("psqa", {}, over)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if args.model:
        import hashlib

        model_dir = Path(args.model)
        digest = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
        base = {"path": str(model_dir), "given": True, "weights_sha256": digest}
    else:
        model_dir, base = build_base(cfg, EmbeddedPaths(root, run), args, root)
        if args.base_only:
            print(model_dir)
            return 0
    over["model.path"] = str(model_dir)
    base_s = time.monotonic() - t0
    runs, recipes = {}, {}
    for backend in backends:
        rc, rl_s, rows, waits, recipes[backend] = _run_backend(backend, over, args, root)
        runs[backend] = {"run_rc": rc, **summarize(rows, waits, rl_s)}
        _log(f"{backend}: held-out {runs[backend]['heldout_first']} -> last {runs[backend]['heldout_last']} "
             f"(mean of last 3 {runs[backend]['heldout_mean_last3']}), {runs[backend]['steps']} steps, "
             f"{runs[backend]['learner_steps_per_hour']} steps/h")
    if args.pair_with:  # a device call's time limit can split the pair over two calls on one cached base
        earlier = json.loads(Path(args.pair_with).read_text())
        if earlier.get("base", {}).get("weights_sha256") != base.get("weights_sha256"):
            print(f"error: --pair-with {args.pair_with} ran on another base", file=sys.stderr)
            return 2
        runs = {**earlier["runs"], **runs}
        recipes = {**earlier["recipes"], **recipes}
    prov = provenance()
    result = {
        "bench": "psqa_gpu", "commit": prov["commit"], "provenance": prov, "machine": machine_info(),
        "command": command(argv, "bench.psqa_gpu"), "base_seconds": round(base_s, 1), "base": base,
        "backends": backends, "recipes": recipes,
        "note": "each backend's launcher session (learner start, RL window, final evaluation) is its rl_seconds; "
                "the RL window itself is the recipe's embedded.time_budget_s. Same base, seed and recipe; the "
                "backends differ in what BACKEND_OVERRIDES sets (precision and optimizer states)",
        "runs": runs, "paired": paired(runs),
        **(runs[backends[0]] if len(backends) == 1 else {}),  # one backend: its figures at the top, as before
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _log(f"wrote {out}")
    return 0 if all(r["run_rc"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
