"""The whole loop on one GPU box, through the launch a user runs: native engine, file bucket, reference workers.

    python -m bench.gpu_loop [--parts learning,throughput] [--rl-seconds 420] [--out bench/results/gpu_loop.json]

Two parts, `learning` (a small Qwen2 supervised to the middle of the accuracy band, then RL) and
`throughput` (Qwen2.5-1.5B shapes with random weights, the quickstart recipe as shipped), both stood up
with `infra.launch_gpu.launch_on_this_box` and reference workers on the same box.
More in docs/performance.md (module notes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

from worker_contract.cli import number

from .coin_task import NAME as COIN
from .common import RESULTS, command, machine_info, provenance, validation_problems

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / ".stoa" / "gpu_loop"
#: the throughput part's reward, as its result states it
TPUT_REWARDS = {
    COIN: "bench-coin (bench/coin_task.py, benchmark only): the arithmetic prompts, reward = the first bit of "
          "BLAKE2b of the completion's decoded text, a fair coin per sample; random weights earn 0 on the real "
          "task, which makes every advantage, the gradient and every patch zero, while a coin gives Adam "
          "(step normalised by the gradient's scale) a gradient to follow at the recipe's lr, so patches "
          "carry what a real step changes",
    "arithmetic": "arithmetic (the real task): 0 for every sample on random weights, so no weight moves and "
                  "every patch is empty",
}


def _log(msg: str) -> None:
    print(f"[gpu_loop {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- models built on the spot ---------------------------------------------------------------------------
def build_learning_base(out: Path, *, max_steps: int, target: float, eval_every: int = 50,
                        eval_problems: int = 200) -> dict:
    """A Qwen2 of ~25M parameters supervised on the GPU until greedy accuracy on a validation split (training
    problems the supervision never reaches) first reaches `target` (or `max_steps`): partly right, as the
    embedded base is, so RL has signal and room. The test split, which RL's held-out figures use, is scored
    once at the end and never chooses when to stop."""
    import random

    import torch

    from embedded.basemodel import SFTSteps, _render, build_model, build_tokenizer, evaluate
    from embedded.config import EmbeddedBaseConfig
    from worker_contract.tasks import get_task

    cfg = EmbeddedBaseConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536,
                             vocab_size=512, sft_steps=max_steps, sft_batch_size=64, sft_lr=1e-3,
                             sft_direct_fraction=0.5)
    task = get_task("arithmetic")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    t0 = time.monotonic()
    train = task.dataset("train")
    tok = build_tokenizer([_render(task, train[i]) for i in range(cfg.tokenizer_corpus)], cfg.vocab_size)
    model = build_model(tok, cfg).to("cuda")
    params = sum(p.numel() for p in model.parameters())
    sft = SFTSteps(model, tok, task, cfg)
    val = validation_problems(task, eval_problems)
    curve, step = [], 0
    model.train()  # `evaluate` puts it back in training mode
    for step in range(1, max_steps + 1):
        loss = sft.step(step)  # counted from 1, so batch 0 is never used (kept: the recorded runs did so)
        if step % eval_every == 0:
            acc = evaluate(model, tok, task, val, max_new_tokens=48)
            curve.append({"step": step, "loss": round(loss.item(), 4), "validation": acc})
            _log(f"base: supervised step {step}, loss {loss.item():.3f}, greedy validation {100 * acc:.1f}%")
            if acc >= target:
                break
    test_acc = evaluate(model, tok, task, task.dataset("test")[:eval_problems], max_new_tokens=48)
    model.eval()
    model.to("cpu").save_pretrained(out)
    tok.save_pretrained(out)
    return {"path": str(out), "params": params, "sft_steps": step, "sft_seconds": round(time.monotonic() - t0, 1),
            "curve": curve, "stopped_on": f"validation ({eval_problems} training problems the supervision never reaches)",
            "test_accuracy": test_acc, "config": cfg.model_dump(mode="json")}


def build_random_qwen(out: Path, hf_id: str = "Qwen/Qwen2.5-1.5B-Instruct") -> dict:
    """Random weights in the shapes of `hf_id` (norms and biases randomised too), bf16 safetensors, with the
    embedded run's small tokenizer (its ids are a subset of the model's vocabulary)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from embedded.basemodel import _render, build_tokenizer
    from infra.slime_launch import KNOWN_HF_CONFIGS
    from worker_contract.tasks import get_task

    task = get_task("arithmetic")
    train = task.dataset("train")
    tok = build_tokenizer([_render(task, train[i]) for i in range(2000)], 512)
    facts = {k: v for k, v in KNOWN_HF_CONFIGS[hf_id].items() if k != "model_type"}
    theta = facts.pop("rope_theta")
    config = Qwen2Config(**facts, rope_parameters={"rope_type": "default", "rope_theta": theta},
                         max_position_embeddings=32768, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.8, 1.2)
                elif name.endswith(".bias"):
                    p.normal_(0.0, 0.02)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return {"path": str(out), "params": params, "shapes_of": hf_id}


# -- the launch and the processes around it -------------------------------------------------------------
def launch(cfg) -> tuple[int, float]:
    """The user's on-box launch (infra.launch_gpu), timed."""
    from infra.launch_gpu import launch_on_this_box

    t0 = time.monotonic()
    rc = launch_on_this_box(cfg, out=lambda m: _log(m), err=lambda m: _log(m))
    return rc, time.monotonic() - t0


def start_workers(procs, cfg, model_dir: str, n: int, *, cpu: bool, threads: int, cap: int, first: int = 1,
                  log_dir: Path, batch_groups: int = 1, module: str = "worker_contract.worker") -> list:
    """`n` reference workers (`python -m <module>`: the reference worker, or bench.coin_task's for its task),
    joined with the run's join card, as an operator's workers are."""
    from worker_contract.joincard import build_card
    from worker_contract.store import open_store

    card = build_card(open_store(cfg.store), cfg.run, os.environ)
    env = {**os.environ, **card.env(reveal=True), "PYTHONUNBUFFERED": "1", "DRL_PROGRESS": "0", "OMP_NUM_THREADS": str(threads)}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    out = []
    for i in range(first, first + n):
        argv = [sys.executable, "-m", module, "--store", cfg.store, "--run", cfg.run,
                "--model", model_dir, "--worker-id", f"w{i}", "--threads", str(threads), "--log-every", "30",
                "--max-groups-per-version", str(cap), "--batch-groups", str(batch_groups)]
        out.append(procs.start(f"worker-{i}", argv, env, log_dir / f"worker-{i}.log"))
    return out


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def stop_learner(cfg, timeout_s: float = 60.0) -> None:
    """`invoke stop` on this box, then anything left in the learner's session (Ray's processes), by PID."""
    from infra import boxops
    from infra.slime_launch import BoxPaths

    paths = BoxPaths(remote_dir=str(REPO), run=cfg.run)
    rec = boxops.read_pid(paths.pid_file)
    boxops.stop(str(REPO), cfg.run, timeout_s=timeout_s, log=_log)
    if rec is None:
        return
    for d in Path("/proc").iterdir():  # processes of the learner's session that outlived it
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == rec[0]:
                    os.kill(int(d.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


def resolve_cfg(run: str, model_dir: str, store: str, overrides: dict):
    from trainer.config import resolve

    return resolve("gsm8k", {}, {"run": run, "model.path": model_dir, "store": store, **overrides})


# -- part (a): learning ---------------------------------------------------------------------------------
def part_learning(args) -> dict:
    from embedded.heldout import HeldoutEvaluator
    from embedded.localprocs import Processes
    from worker_contract.store import open_store
    from worker_contract.tasks import get_task

    root = ROOT / f"learning{args.tag}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    base_dir = Path(args.base) if args.base else root / "base"
    if (base_dir / "base.json").exists():  # built by an earlier call (several RL settings on one base)
        base = json.loads((base_dir / "base.json").read_text())
    else:
        base = build_learning_base(base_dir, max_steps=args.sft_max_steps, target=args.sft_target)
        (base_dir / "base.json").write_text(json.dumps(base, indent=2) + "\n")
    _log(f"base: {base['params'] / 1e6:.1f} M parameters, {base['sft_steps']} steps in {base['sft_seconds']} s")
    run = f"gpu-loop-learn{args.tag}-{int(time.time())}"
    cfg = resolve_cfg(run, base["path"], f"file://{root / 'bucket'}", {
        "task": "arithmetic", "model.dtype": "float32", "optim.lr": args.lr, "algo.max_new_tokens": 48,
        "train.backend": "megatron", "compute.max_tokens_per_gpu": None, "compute.micro_batch_size": 64,
        "checkpoint.interval": 50, "train.anchor_interval": 20, "train.poll_interval_s": 0.5,
        "train.num_steps": 100000})
    rc, launch_s = launch(cfg)
    result: dict = {"base": base, "launch_rc": rc, "launch_s": round(launch_s, 1), "recipe": cfg.model_dump(mode="json")}
    if rc != 0:
        return result
    from infra.slime_launch import BoxPaths

    paths = BoxPaths(remote_dir=str(REPO), run=run)
    metrics = Path(paths.state_dir) / "metrics.jsonl"
    evaluator = HeldoutEvaluator(open_store(cfg.store), run, cfg.contract.plane, base["path"], get_task(cfg.task),
                                 problems=400, max_new_tokens=48, temperature=None, metrics_path=root / "eval.jsonl",
                                 threads=args.eval_threads)
    procs = Processes()
    cap = max(1, -(-cfg.algo.groups_per_step // args.workers))
    t_rl = time.monotonic()
    try:
        start_workers(procs, cfg, base["path"], args.workers, cpu=True, threads=args.worker_threads, cap=cap,
                      log_dir=root)
        evaluator.start()
        evaluator.request()  # the first published version: the base
        last_eval = 0
        while time.monotonic() - t_rl < args.rl_seconds:
            time.sleep(2)
            rows = [r for r in read_rows(metrics) if "train/loss" in r or "train/grad_norm" in r]
            step = rows[-1]["step"] if rows else 0
            if step >= last_eval + 10 and not evaluator.busy:
                last_eval = step - step % 10
                evaluator.request()
            if evaluator.results and int(time.monotonic() - t_rl) % 30 < 2:
                best = max(r["eval/accuracy"] for r in evaluator.results)
                _log(f"RL {time.monotonic() - t_rl:.0f} s: step {step}, held-out first "
                     f"{100 * evaluator.results[0]['eval/accuracy']:.1f}%, best {100 * best:.1f}%")
        rl_s = time.monotonic() - t_rl
        evaluator.request()
        time.sleep(1)
    finally:
        stop_learner(cfg)
        procs.stop(timeout_s=20)
    evaluator.close()
    rows = [r for r in read_rows(metrics) if "train/grad_norm" in r]
    evals = sorted(evaluator.results, key=lambda r: r["eval/version"])
    result.update(summary_learning(rows, evals, rl_s, args.workers))
    return result


def summary_learning(rows: list[dict], evals: list[dict], rl_s: float, workers: int) -> dict:
    first = evals[0]["eval/accuracy"] if evals else None
    best = max((e["eval/accuracy"] for e in evals), default=None)
    last = evals[-1]["eval/accuracy"] if evals else None
    last3 = _mean([e["eval/accuracy"] for e in evals[-3:]])  # what the run ended at, less one lucky evaluation
    mism = [v for r in rows for k, v in r.items() if k.endswith("/logprob_mismatch")]
    reused = [r.get("rollout/reused_frac", 0.0) for r in rows]
    return {
        "rl_seconds": round(rl_s, 1), "workers": workers, "steps": rows[-1]["step"] if rows else 0,
        "heldout_first": first, "heldout_best": best, "heldout_last": last, "heldout_mean_last3": last3,
        "gain_best_points": None if first is None else round(100 * (best - first), 2),
        "gain_last_points": None if first is None else round(100 * (last - first), 2),
        "gain_mean_last3_points": None if first is None else round(100 * (last3 - first), 2),
        "evals": [{k: e.get(k) for k in ("step", "eval/version", "eval/accuracy", "eval/seconds")} for e in evals],
        "train_reward_first20": _mean([r.get("rollout/raw_reward") for r in rows[:20]]),
        "train_reward_last20": _mean([r.get("rollout/raw_reward") for r in rows[-20:]]),
        "reused_frac_mean": _mean(reused), "worker_logprob_mismatch_mean": _mean(mism),
        "step_time_s_median": _median([r.get("train/step_time_s") for r in rows]),
    }


def _mean(xs) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return round(statistics.fmean(xs), 5) if xs else None


def _median(xs) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return round(statistics.median(xs), 5) if xs else None


# -- part (b): throughput -------------------------------------------------------------------------------
class Follower(threading.Thread):
    """A reconstructor following the pointer as a worker does: for each new version, the time from seeing
    the pointer move to holding the new weights (patch fetched, verified, applied, dense plane made)."""

    def __init__(self, store, run: str, plane: str, poll_s: float = 0.05):
        super().__init__(daemon=True)
        self.store, self.run_id, self.plane, self.poll_s = store, run, plane, poll_s  # not self.run: Thread.run
        self.lags: list[dict] = []
        self.stop_evt = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        from worker_contract.manifest import load_manifest
        from worker_contract.planes import get_plane
        from worker_contract.pointer import read_pointer
        from worker_contract.reconstruct import Reconstructor

        try:
            key = load_manifest(self.store, self.run_id).trainer_public_key
            rec = Reconstructor(self.store, self.run_id, plane=self.plane, public_key=key)
            rec.join()
            plane = get_plane(self.plane)
            while not self.stop_evt.wait(self.poll_s):
                pointer, _ = read_pointer(self.store, self.run_id, key)
                if pointer is None or pointer.version <= rec.version:
                    continue
                t0 = time.monotonic()
                before = rec.version
                if rec.follow() is None:
                    continue
                plane.to_dense(rec.state)
                self.lags.append({"from": before, "to": rec.version, "seconds": round(time.monotonic() - t0, 3)})
        except Exception as e:  # reported in the result, never fatal to the benchmark
            self.error = f"{type(e).__name__}: {e}"


def _joined_at(log: Path, started: float, timeout_s: float, alive=lambda: True) -> float | None:
    """Seconds from `started` to the worker's join in `log`; None at the timeout, or as soon as `alive()` (the
    learner the worker waits for) is false."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        if log.exists() and " joined run " in log.read_text(errors="replace"):
            return time.monotonic() - started
        time.sleep(0.2)
    return None


def part_throughput(args) -> dict:
    from embedded.localprocs import Processes
    from worker_contract import layout
    from worker_contract.store import open_store

    root = ROOT / "throughput"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t0 = time.monotonic()
    model = build_random_qwen(root / "model")
    model["build_s"] = round(time.monotonic() - t0, 1)
    _log(f"random Qwen2.5-1.5B shapes: {model['params'] / 1e9:.3f} B parameters in {model['build_s']} s")
    run = f"gpu-loop-tput-{int(time.time())}"
    cfg = resolve_cfg(run, model["path"], f"file://{root / 'bucket'}", {
        "task": args.tput_task, "checkpoint.interval": 100000, "train.num_steps": 100000,
        "algo.max_new_tokens": args.tput_max_new_tokens})  # None: the recipe's 1024
    rc, launch_s = launch(cfg)
    result: dict = {"model": model, "reward": TPUT_REWARDS[args.tput_task], "launch_rc": rc,
                    "launch_s": round(launch_s, 1), "recipe": cfg.model_dump(mode="json")}
    if rc != 0:
        return result
    from infra.slime_launch import BoxPaths

    paths = BoxPaths(remote_dir=str(REPO), run=run)
    metrics = Path(paths.state_dir) / "metrics.jsonl"
    procs = Processes()
    store = open_store(cfg.store)
    follower = Follower(store, run, cfg.contract.plane)
    cold: dict = {}
    # one batch per version (the cap is the batch): a worker that sampled a batch at version v waits for v+1
    # rather than sampling a second batch that would land further behind the learner
    bg = args.batch_groups
    module = "bench.coin_task" if args.tput_task == COIN else "worker_contract.worker"
    workers = {"n": args.gpu_workers, "batch_groups": bg, "max_groups_per_version": bg, "module": module}
    end_by = t0 + args.tput_deadline_s if args.tput_deadline_s else float("inf")
    try:
        t_w = time.monotonic()
        start_workers(procs, cfg, model["path"], args.gpu_workers, cpu=False, threads=1, cap=bg, log_dir=root,
                      batch_groups=bg, module=module)
        first_join = _joined_at(root / "worker-1.log", t_w, 300)
        follower.start()
        t_run, t_run_at = time.monotonic(), time.time()
        groups_before = len(store.list_keys(layout.rollouts_prefix(run)))
        joined_late = False
        while time.monotonic() - t_run < args.tput_seconds and time.monotonic() < end_by:
            time.sleep(2)
            rows = [r for r in read_rows(metrics) if "train/grad_norm" in r]
            if not joined_late and len(rows) >= args.cold_join_after:  # once there are patches to catch up on
                joined_late = True
                t_c = time.monotonic()
                n = args.gpu_workers + 1
                start_workers(procs, cfg, model["path"], 1, cpu=False, threads=1, cap=bg, first=n, log_dir=root,
                              batch_groups=bg, module=module)
                wait_s = max(1.0, min(240.0, end_by - time.monotonic()))
                cold = {"after_steps": rows[-1]["step"], "seconds": _joined_at(root / f"worker-{n}.log", t_c, wait_s)}
                _log(f"cold join after step {cold['after_steps']}: {cold['seconds']} s")
            if rows and int(time.monotonic() - t_run) % 30 < 2:
                _log(f"throughput {time.monotonic() - t_run:.0f} s: step {rows[-1]['step']}")
        wall, t_end_at = time.monotonic() - t_run, time.time()
        workers["groups_uploaded_in_window"] = len(store.list_keys(layout.rollouts_prefix(run))) - groups_before
    finally:
        follower.stop_evt.set()
        stop_learner(cfg, timeout_s=5)  # its final checkpoint (25 GB of float32 state) is not what we measure
        procs.stop(timeout_s=20)
    rows = [r for r in read_rows(metrics) if "train/grad_norm" in r]
    workers["sampling_tokens_per_s"] = _worker_log_rates(root)
    result.update(summary_throughput(rows, wall, args.gpu_workers, first_join, cold, follower, (t_run_at, t_end_at)))
    result["workers"] = workers
    length = result.get("response_len_mean") or 0.0
    if wall > 0:  # everything the workers uploaded in the window, used or not (stale groups included)
        workers["uploaded_tokens_per_s"] = round(
            workers["groups_uploaded_in_window"] * cfg.contract.n_samples * length / wall, 1)
    return result


def _worker_log_rates(root: Path) -> dict[str, float]:
    """Each worker's last reported sampling rate (its status line: response tokens over sampling time)."""
    import re

    out = {}
    for log in sorted(root.glob("worker-*.log")):
        rates = re.findall(r"([\d.]+) tokens/s", log.read_text(errors="replace"))
        if rates:
            out[log.stem] = float(rates[-1])
    return out


def summary_throughput(rows: list[dict], wall: float, workers: int, first_join, cold: dict, follower,
                       window_at: tuple[float, float] | None = None) -> dict:
    """`wall`: the window's length; `window_at`: its start and end (epoch seconds, as the rows' `time`)."""
    steps = rows[1:]  # the first step's row carries the learner's warm-up
    # wall time between two rows, less the time the learner waited for rollouts: its time while fed
    fed = [b["time"] - a["time"] - b.get("learner/wait_s", 0.0) for a, b in zip(rows, rows[1:], strict=False)]
    compute = [r.get("train/step_time_s", 0.0) for r in steps]  # the step alone, publishing excluded
    busy = sum(compute) / sum(fed) if fed and sum(fed) > 0 else None
    blocking = [r.get("publish/blocking_s") for r in steps]
    # each row carries the newest finished publish's figures: one value per patched version (an anchor's
    # figures have no `changed`, and its patch_bytes would be the whole state)
    patches = list({r.get("publish/version"): r["publish/patch_bytes"] for r in steps
                    if r.get("publish/changed") is not None and r.get("publish/patch_bytes") is not None}.values())
    window = rows[-1]["time"] - rows[0]["time"] if len(rows) > 1 else None
    inside = [r for r in rows if window_at is None or window_at[0] <= r["time"] <= window_at[1]]
    in_steps = sum(r.get("train/step_time_s", 0.0) for r in inside)
    return {
        "workers": workers, "wall_s": round(wall, 1), "steps": len(rows),
        # the whole window, waits for rollouts included: what the GPU learner did with the time it had
        "steps_in_window": len(inside), "busy_share_window": round(in_steps / wall, 4) if wall > 0 else None,
        "steps_per_hour_measured": round(3600 * (len(rows) - 1) / window, 1) if window else None,
        "steps_per_hour_fed": round(3600 / statistics.fmean(fed), 1) if fed else None,
        "busy_share_fed": round(busy, 4) if busy is not None else None,
        "wait_s_mean": _mean([r.get("learner/wait_s") for r in steps]),
        "step_time_s_median": _median([r.get("train/step_time_s") for r in steps]),
        "compute_s_median": _median(compute),
        "publish_blocking_s_median": _median(blocking), "publish_blocking_s_max": max(
            (float(b) for b in blocking if b is not None), default=None),
        "publish_blocking_s_max_all_steps": max(  # the first step's too
            (float(r["publish/blocking_s"]) for r in rows if r.get("publish/blocking_s") is not None), default=None),
        "publish_encode_s_median": _median([r.get("publish/encode_s") for r in steps]),
        "publish_latency_s_median": _median([r.get("publish/latency_s") for r in steps]),
        "patch_bytes_median": _median(patches), "patch_bytes_max": max(patches, default=None),
        "patch_bytes_min": min(patches, default=None), "patches": len(patches),
        "grad_norm_median": _median([r.get("train/grad_norm") for r in rows]),
        "raw_reward_mean": _mean([r.get("rollout/raw_reward") for r in rows]),
        "skipped_states": rows[-1].get("publish/skipped_states") if rows else None,
        "staleness_mean": _mean([r.get("rollout/staleness_mean") for r in steps]),
        "accepted_groups": rows[-1].get("rollout/accepted") if rows else None,
        "drops": {k.split("/", 2)[2]: v for k, v in (rows[-1] if rows else {}).items()
                  if k.startswith("rollout/drops/") and v},
        "response_len_mean": _mean([r.get("rollout/response_len_mean") for r in steps]),
        "worker_tokens_per_s": _worker_rate(rows),
        "reused_frac_mean": _mean([r.get("rollout/reused_frac") for r in steps]),
        "follower_lag_s": [x["seconds"] for x in follower.lags],
        "follower_follows": follower.lags,  # from and to versions of each follow (one may apply several patches)
        "follower_lag_s_median": _median([x["seconds"] for x in follower.lags]),
        "follower_lag_s_max": max((x["seconds"] for x in follower.lags), default=None),
        "follower_error": follower.error, "first_worker_join_s": first_join, "cold_join": cold,
        "sparsity_median": _median([r.get("publish/sparsity") for r in steps if r.get("publish/changed") is not None]),
        "rows": [{k: r.get(k) for k in ("step", "time", "train/step_time_s", "learner/wait_s", "publish/blocking_s",
                                        "publish/version", "publish/patch_bytes", "publish/anchor_bytes",
                                        "publish/encode_s", "publish/upload_s", "publish/latency_s",
                                        "publish/queue_wait_s", "publish/changed", "publish/sparsity", "version",
                                        "batch_version", "rollout/staleness_mean", "rollout/reused_frac",
                                        "rollout/raw_reward", "train/grad_norm", "rollout/drops/stale")}
                 for r in rows],
    }


def _worker_rate(rows: list[dict]) -> float | None:
    """Sampled tokens per second of all workers together, from the groups the learner accepted between its
    first and last row (groups x samples x mean response length)."""
    if len(rows) < 2 or "rollout/accepted" not in rows[0]:
        return None
    groups = rows[-1]["rollout/accepted"] - rows[0]["rollout/accepted"]
    length = _mean([r.get("rollout/response_len_mean") for r in rows]) or 0.0
    dt = rows[-1]["time"] - rows[0]["time"]
    return round(groups * 8 * length / dt, 1) if dt > 0 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_loop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="learning,throughput")
    ap.add_argument("--rl-seconds", type=number(float, above=0), default=420.0)
    ap.add_argument("--workers", type=number(int, at_least=1), default=4, help="CPU workers of the learning part")
    ap.add_argument("--worker-threads", type=number(int, at_least=1), default=2)
    ap.add_argument("--eval-threads", type=number(int, at_least=1), default=3)
    ap.add_argument("--lr", type=number(float, above=0), default=1e-5)
    ap.add_argument("--sft-max-steps", type=number(int, at_least=1), default=600, help="supervised steps planned (cosine schedule)")
    ap.add_argument("--sft-target", type=number(float, above=0, at_most=1), default=0.45, help="stop supervising once greedy held-out reaches it")
    ap.add_argument("--base", default=None, help="the learning base's directory: reused when built, else built there")
    ap.add_argument("--tag", default="", help="suffix of the part's directory and run id (several at once)")
    ap.add_argument("--gpu-workers", type=number(int, at_least=1), default=2, help="GPU workers of the throughput part")
    ap.add_argument("--batch-groups", type=number(int, at_least=1), default=16,
                    help="groups each GPU worker samples in one batched forward (and at most per version)")
    ap.add_argument("--tput-seconds", type=number(float, above=0), default=300.0, help="the throughput window, from the first join")
    ap.add_argument("--tput-deadline-s", type=number(float, above=0), default=None,
                    help="end the throughput window by this many seconds after the part started (a device call's limit)")
    ap.add_argument("--tput-max-new-tokens", type=number(int, at_least=1), default=None,
                    help="response budget of the throughput part (default: the recipe's 1024)")
    ap.add_argument("--cold-join-after", type=number(int, at_least=0), default=3, help="learner steps before the late worker starts")
    ap.add_argument("--tput-task", choices=sorted(TPUT_REWARDS), default=COIN,
                    help="the throughput part's task: bench-coin (a coin per sample, the default) or arithmetic "
                         "(the real task: reward 0 on random weights, empty patches)")
    ap.add_argument("--out", default=str(RESULTS / "gpu_loop.json"))
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in ("learning", "throughput")]:
        ap.error(f"--parts {args.parts!r}: {', '.join(unknown)} is no part (learning, throughput)")
    import torch

    if not torch.cuda.is_available():  # it once ran both parts into errors and reported success
        print("python -m bench.gpu_loop: needs a CUDA GPU and this machine has none (nothing run, nothing "
              "written); run it on the GPU box", file=sys.stderr)
        return 2
    os.environ.setdefault("DRL_MIN_FREE_GB", "20")  # the device's disk is 64 GB; a rented box keeps 100
    os.environ.setdefault("DRL_RAY_DASHBOARD", "0")
    result: dict = {**provenance(), "command": command(argv, "bench.gpu_loop"),
                    "machine": machine_info(), "args": vars(args)}
    out = Path(args.out)
    for part in parts:
        t0 = time.monotonic()
        try:
            result[part] = {"learning": part_learning, "throughput": part_throughput}[part](args)
        except Exception as e:  # one part's failure is reported; the other still runs
            import traceback

            result[part] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        result[part]["part_seconds"] = round(time.monotonic() - t0, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        _log(f"{part} done in {result[part]['part_seconds']} s: "
             + json.dumps({k: v for k, v in result[part].items() if not isinstance(v, list | dict)}, default=str))
    failed = [p for p in parts if "error" in result[p]]
    if failed:
        print(f"python -m bench.gpu_loop: part(s) {', '.join(failed)} failed (the error is in {out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
