"""LFM2.5-8B-A1B in the whole loop on one GPU: the fleet recipe's learner on random weights, the publisher, a CPU
follower checking every version bit-exact, coin-task workers, a cold join, checkpoints, a kill and a resume.

    python -m bench.lfm2_loop [--seconds 300] [--planes int8g64,bf16] [--out bench/results/lfm2_loop.json]
    python -m bench.lfm2_loop --tiny --device cpu --steps 6     # smoke (megatron: DRL_MEGATRON_CPU_SETUP)

More in docs/performance.md (module notes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from worker_contract.cli import number

from .coin_task import NAME as COIN
from .common import RESULTS, command, machine_info, provenance
from .gpu_loop import _joined_at, read_rows, start_workers, summary_throughput

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / ".stoa" / "lfm2_loop"
LINKS_BPS = {"1gbit": 1e9, "100mbit": 1e8}


def _log(msg: str) -> None:
    print(f"[lfm2_loop {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(out: Path, layers: int, tiny: bool, device: str) -> dict:
    """Random weights of LFM2.5-8B-A1B's shapes (bench/lfm2_step.py's config and randomisation), bf16
    safetensors, with the embedded run's small tokenizer (its ids are a subset of the model's vocabulary)."""
    import torch

    from embedded.basemodel import _render, build_tokenizer
    from worker_contract.tasks import get_task

    from .lfm2_step import lfm2_config, random_model

    task = get_task("arithmetic")
    tok = build_tokenizer([_render(task, task.dataset("train")[i]) for i in range(2000)], 512)
    cfg = lfm2_config(layers, tiny, **({"vocab_size": 512} if tiny else {}))
    cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = tok.eos_token_id, tok.pad_token_id, None
    model, counts = random_model(cfg, device)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"path": str(out), "layers": layers, "shapes_of": "LiquidAI/LFM2.5-8B-A1B", **counts}


class Follower(threading.Thread):
    """A CPU reconstructor following the pointer: every version it reaches is checked bit-exact (each patch's
    result digest against the state it rebuilt, worker_contract/pulse), and timed (fetch, verify, apply)."""

    def __init__(self, store, run: str, plane: str, poll_s: float = 0.05):
        super().__init__(daemon=True)
        self.store, self.run_id, self.plane, self.poll_s = store, run, plane, poll_s
        self.follows: list[dict] = []
        self.stop_evt = threading.Event()
        self.error: str | None = None
        self.joined: int | None = None

    def run(self) -> None:
        from worker_contract.manifest import load_manifest
        from worker_contract.pointer import read_pointer
        from worker_contract.reconstruct import Reconstructor

        try:
            key = load_manifest(self.store, self.run_id).trainer_public_key
            rec = Reconstructor(self.store, self.run_id, plane=self.plane, public_key=key)
            rec.join()
            self.joined = rec.version
            while not self.stop_evt.wait(self.poll_s):
                pointer, _ = read_pointer(self.store, self.run_id, key)
                if pointer is None or pointer.version <= rec.version:
                    continue
                t0, before = time.monotonic(), rec.version
                if rec.follow() is None:
                    continue
                s = time.monotonic() - t0
                self.follows.append({"from": before, "to": rec.version, "seconds": round(s, 3),
                                     "per_version_s": round(s / max(1, rec.version - before), 3)})
        except Exception as e:  # reported in the result, never fatal to the benchmark
            self.error = f"{type(e).__name__}: {e}"


def cold_join(store, run: str, plane: str) -> dict:
    """A fresh reconstructor's join now (the newest anchor, then every patch since), timed on this machine's
    cores, and its bytes as a download time on each link of LINKS_BPS."""
    from worker_contract import layout
    from worker_contract.manifest import load_manifest
    from worker_contract.reconstruct import Reconstructor

    t0 = time.monotonic()
    rec = Reconstructor(store, run, plane=plane, public_key=load_manifest(store, run).trainer_public_key)
    rec.join()
    seconds = time.monotonic() - t0
    anchors = sorted({v for o in store.list(layout.anchors_prefix(run)) if (v := layout.anchor_version_of(o.key))
                      is not None and v <= rec.version})
    anchor = anchors[-1]
    anchor_bytes = sum(o.size for o in store.list(layout.anchor_prefix(run, anchor)))
    patch_bytes = sum(o.size for o in store.list(layout.versions_prefix(run))
                      if (v := layout.patch_version_of(o.key)) is not None and anchor < v <= rec.version)
    total = anchor_bytes + patch_bytes
    return {"version": rec.version, "anchor": anchor, "patches": rec.version - anchor, "seconds": round(seconds, 4),
            "anchor_bytes": anchor_bytes, "patch_bytes": patch_bytes, "cores": os.cpu_count(),
            **{f"download_s_{k}": round(8 * total / bps, 3) for k, bps in LINKS_BPS.items()}}


class Memory(threading.Thread):
    """Peaks, every second: the GPU's used memory (nvidia-smi; the learner's, the publisher's snapshot in it,
    a GPU worker's) and the host's (total less available: at 8 B the learner's offloaded optimizer state, a CPU
    worker's copy, the follower and the cold join share a 128 GiB machine)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_mib: int | None = None
        self.peak_host_gib: float | None = None
        self.stop_evt = threading.Event()

    def run(self) -> None:
        import psutil

        gpu = True
        while not self.stop_evt.wait(1.0):
            vm = psutil.virtual_memory()
            self.peak_host_gib = max(self.peak_host_gib or 0.0, round((vm.total - vm.available) / 2**30, 1))
            if not gpu:
                continue
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout.split()
            except (OSError, subprocess.SubprocessError):
                gpu = False
                continue
            if out:
                self.peak_mib = max(self.peak_mib or 0, int(out[0]))


def resolve_cfg(args, run: str, store: str, model_dir: str, plane: str):
    from trainer.config import resolve

    over = {"run": run, "store": store, "model.path": model_dir, "task": COIN, "contract.plane": plane,
            "train.engine": "native", "train.backend": "megatron", "train.num_steps": 100000,
            "train.poll_interval_s": 0.5, "algo.max_new_tokens": args.max_new_tokens}
    if args.tiny:
        over.update({"algo.groups_per_step": 2, "checkpoint.interval": 2, "train.anchor_interval": 4,
                     "compute.micro_batch_size": 8})
    if args.checkpoint_interval is not None:
        over["checkpoint.interval"] = args.checkpoint_interval
    return resolve("psqa", {}, over)


def _wait_rows(metrics: Path, n: int, timeout_s: float, learner) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and learner.alive():
        rows = [r for r in read_rows(metrics) if "train/grad_norm" in r]
        if len(rows) >= n:
            return rows
        time.sleep(1.0)
    return [r for r in read_rows(metrics) if "train/grad_norm" in r]


def _wait_ray_gone(run_dir: Path, timeout_s: float = 120.0) -> None:
    """Until no process of the run's Ray is left. Ray's actors are each in a process group of their own, so a
    SIGKILL to the learner's group leaves the learner actor to notice its raylet is gone, and one saving a
    checkpoint can finish it first."""
    import psutil

    from trainer.ray_runtime import ray_tmpdir

    tmp = str(ray_tmpdir(run_dir)[0])  # what ray_session set as RAY_TMPDIR, inherited by every Ray process

    def ours(p: psutil.Process) -> bool:
        try:
            return p.pid != os.getpid() and p.environ().get("RAY_TMPDIR") == tmp
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(ours(p) for p in psutil.process_iter()):
        time.sleep(0.5)


def kill_and_resume(procs, cfg, paths, model_dir: str, learner, extra_env: dict) -> tuple[dict, object]:
    """SIGKILL the learner's process group mid-run, relaunch it: it must resume from its newest checkpoint and
    go on at the next version with nothing lost. Returns (the figures, the new learner)."""
    from embedded.localprocs import start_learner
    from trainer import checkpoint
    from worker_contract.pointer import read_pointer
    from worker_contract.store import open_store

    store = open_store(cfg.store)
    procs.signal(learner, signal.SIGKILL)
    learner.proc.wait()
    _wait_ray_gone(paths.run_dir)
    # read once every process of the killed learner is gone: a row or a checkpoint it wrote after an earlier
    # read would pass for the resumed learner's
    rows = [r for r in read_rows(paths.metrics) if "train/grad_norm" in r]
    killed_at = rows[-1]["step"] if rows else 0
    from worker_contract.manifest import load_manifest

    key = load_manifest(store, cfg.run).trainer_public_key
    pointer, _ = read_pointer(store, cfg.run, key)
    ckpt = checkpoint.latest(paths.run_dir / "checkpoints")
    ckpt_step = checkpoint.read_state(ckpt).step if ckpt is not None else 0
    t0 = time.monotonic()
    learner = start_learner(procs, cfg, paths, Path(model_dir), extra_env)
    after = _wait_rows(paths.metrics, len(rows) + 1, 1800, learner)
    resumed = [r for r in after[len(rows):]]
    first = resumed[0] if resumed else None
    return {"killed_after_step": killed_at, "checkpoint_step": ckpt_step,
            "pointer_before": pointer.version if pointer else None,
            "first_step_after": first["step"] if first else None,
            "first_version_after": first.get("version") if first else None,
            "resume_to_first_step_s": round(time.monotonic() - t0, 1) if first else None,
            "continues_at_next_version": bool(first and pointer and first.get("version", 0) > pointer.version),
            "continues_from_checkpoint": bool(first and first["step"] == ckpt_step + 1)}, learner


def checkpoint_figures(rows: list[dict], cfg, model: dict) -> dict:
    """What checkpoints cost the learner (the rows' checkpoint/* figures) and the disk the recipe needs."""
    from infra.slime_launch import checkpoint_bytes, disk_need_gb

    writes = {r["checkpoint/step"]: r for r in rows if r.get("checkpoint/step") is not None}
    stalls = [r.get("checkpoint/blocking_s", 0.0) + r.get("checkpoint/update_wait_s", 0.0) for r in rows]
    busy = sum(r.get("train/step_time_s", 0.0) for r in rows)
    hf = json.loads((Path(model["path"]) / "config.json").read_text())
    return {"save_interval": cfg.checkpoint.interval, "keep": cfg.checkpoint.keep, "written": len(writes),
            "bytes": [w["checkpoint/bytes"] for w in writes.values()],
            "write_s": [w["checkpoint/write_s"] for w in writes.values()],
            "read_s": [w["checkpoint/read_s"] for w in writes.values()],
            "step_stall_s": [round(s, 3) for s in stalls if s],
            "stall_share_of_step_time": round(sum(stalls) / busy, 4) if busy else None,
            "bytes_per_param": round(statistics.median(w["checkpoint/bytes"] for w in writes.values())
                                     / model["params"], 3) if writes else None,
            "bytes_per_param_by_formula": checkpoint_bytes(cfg), "disk_need_gb_by_formula": disk_need_gb(cfg, hf)}


def patch_figures(rows: list[dict]) -> dict:
    """Patch bytes per step (median, p90) and the share of unchanged weights, one value per patched version."""
    per = {r["publish/version"]: r for r in rows if r.get("publish/changed") is not None
           and r.get("publish/patch_bytes") is not None}
    sizes = sorted(r["publish/patch_bytes"] for r in per.values())
    unchanged = [r["publish/sparsity"] for r in per.values() if r.get("publish/sparsity") is not None]
    p90 = sizes[min(len(sizes) - 1, int(0.9 * len(sizes)))] if sizes else None
    return {"patch_bytes_median": statistics.median(sizes) if sizes else None, "patch_bytes_p90": p90,
            "unchanged_share_median": round(statistics.median(unchanged), 6) if unchanged else None,
            "anchor_bytes": max((r.get("publish/anchor_bytes") or 0 for r in rows), default=None) or None}


def run_plane(args, plane: str, model: dict, kill: bool, record=lambda _out: None) -> dict:
    """One run on `plane`: the window of --seconds (or --steps), a cold join, and with `kill` the kill-and-resume.
    `record(out)` is called with the figures so far before each long wait (a device call may end in one)."""
    from embedded.localprocs import Processes, start_learner
    from embedded.run import EmbeddedPaths, publish_contract

    run = f"lfm2-loop-{plane}-{int(time.time())}"
    paths = EmbeddedPaths(Path(args.root), run)
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    cfg = resolve_cfg(args, run, paths.store_url, model["path"], plane)
    store, _, _ = publish_contract(cfg, paths, Path(model["path"]))
    env = {"DRL_TORCH_THREADS": str(args.learner_threads)} if args.learner_threads else {}
    procs, follower, mem = Processes(record=paths.run_dir), Follower(store, run, plane), Memory()
    out: dict = {"plane": plane, "run": run, "recipe": cfg.model_dump(mode="json")}
    t_start = time.monotonic()
    try:
        learner = start_learner(procs, cfg, paths, Path(model["path"]), env)
        mem.start()
        bg = args.batch_groups
        start_workers(procs, cfg, model["path"], args.workers, cpu=args.worker_device == "cpu", threads=args.worker_threads,
                      cap=bg, log_dir=paths.run_dir, batch_groups=bg, module="bench.coin_task")
        out["first_worker_join_s"] = _joined_at(paths.run_dir / "worker-1.log", t_start, args.join_timeout_s,
                                                learner.alive)
        _learner_alive(learner, "before the first worker joined")
        if args.follower:
            follower.start()
        t0, t0_at = time.monotonic(), time.time()
        while _window_open(args, t0, learner, paths.metrics):
            time.sleep(1)
        wall, t1_at = time.monotonic() - t0, time.time()
        _learner_alive(learner, "during the window")
        rows = [r for r in read_rows(paths.metrics) if "train/grad_norm" in r]
        out.update(summary_throughput(rows, wall, args.workers, out["first_worker_join_s"], {}, _lags(follower),
                                      (t0_at, t1_at)))
        out.update(patch_figures(rows))
        record(out)  # the window's figures are kept if a call's time limit cuts the cold join (minutes at 8 B)
        out["cold_join"] = cold_join(store, run, plane)
        record(out)
        if kill:
            out["kill_and_resume"], learner = kill_and_resume(procs, cfg, paths, model["path"], learner, env)
            record(out)
    finally:
        follower.stop_evt.set()
        mem.stop_evt.set()
        procs.stop(timeout_s=args.stop_timeout_s)
        # the follower ends its patch in hand first (a minute at 8 B): a daemon thread still in native code when
        # the interpreter exits aborted the process after its result was written (rc 134 on the H100 at 7284f0f)
        for thread in (follower, mem):
            if thread.is_alive():
                thread.join(timeout=300)
    rows = [r for r in read_rows(paths.metrics) if "train/grad_norm" in r]
    out["checkpoints"] = checkpoint_figures(rows, cfg, model)
    out["follower"] = {"ran": args.follower, "joined_at": follower.joined, "follows": follower.follows,
                       "error": follower.error,
                       "versions_reconstructed_bit_exact": sum(f["to"] - f["from"] for f in follower.follows),
                       "apply_s_per_version_median": _median([f["per_version_s"] for f in follower.follows])}
    out["peak_gpu_mib"], out["peak_host_gib"] = mem.peak_mib, mem.peak_host_gib
    out["learner_log_tail"] = (paths.run_dir / "learner.log").read_text(errors="replace")[-3000:]
    return out


def _learner_alive(learner, when: str) -> None:
    """A learner that died (out of memory, say) ends the plane with its own last lines, not a reader's error."""
    if not learner.alive():
        raise RuntimeError(f"the learner exited {when}; the last lines of its log:\n{learner.tail(25)}")


def _window_open(args, t0: float, learner, metrics: Path) -> bool:
    """The window lasts --seconds while the learner runs, and ends sooner at its --steps-th step where given."""
    if time.monotonic() - t0 >= args.seconds or not learner.alive():
        return False
    return args.steps is None or sum("train/grad_norm" in r for r in read_rows(metrics)) < args.steps


def _lags(follower: Follower):
    """The follower's figures as bench.gpu_loop's summary reads them."""
    from types import SimpleNamespace

    return SimpleNamespace(lags=[{"from": f["from"], "to": f["to"], "seconds": f["seconds"]} for f in follower.follows],
                           error=follower.error)


def _write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lfm2_loop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=number(float, above=0), default=300.0, help="each plane's window, from the first worker's join")
    ap.add_argument("--steps", type=number(int, at_least=1), default=None,
                    help="end each plane's window at the learner's Nth step, if that comes before --seconds")
    ap.add_argument("--planes", default="int8g64,bf16", help="one run each; the first also kills and resumes the learner")
    ap.add_argument("--layers", type=number(int, at_least=1), default=24)
    ap.add_argument("--tiny", action="store_true", help="bench.lfm2_step's tiny shape (a smoke run on the CPU)")
    ap.add_argument("--device", default="cuda", help="where the random model is made (the learner takes the GPU)")
    ap.add_argument("--workers", type=number(int, at_least=1), default=1)
    ap.add_argument("--worker-device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: a bf16 copy on the GPU beside the learner (16.7 GB at 8 B; the CPU where there is no "
                         "GPU); cpu: a float32 copy in host memory (33 GB at 8 B: beside the learner's 83 GB it ran the "
                         "one-GPU H200's 128 GiB host out of memory)")
    ap.add_argument("--worker-threads", type=number(int, at_least=1), default=8)
    ap.add_argument("--learner-threads", type=number(int, at_least=0), default=0, help="DRL_TORCH_THREADS of the learner (0: 1)")
    ap.add_argument("--batch-groups", type=number(int, at_least=1), default=8, help="groups a worker samples at once (and per version)")
    ap.add_argument("--max-new-tokens", type=number(int, at_least=1), default=16, help="short episodes (the recipe's is 4096)")
    ap.add_argument("--join-timeout-s", type=number(float, above=0), default=900.0)
    ap.add_argument("--stop-timeout-s", type=number(float, above=0), default=600.0, help="the learner's last checkpoint at the end")
    ap.add_argument("--checkpoint-interval", type=number(int, at_least=1), default=None,
                    help="checkpoint.interval (default: the recipe's). One past the window's steps writes none in it: "
                    "for a disk that cannot hold one (about 67 GB at 8B; the one-GPU H200's disk is 64 GiB), with "
                    "--no-kill, and a short --stop-timeout-s so the learner's last checkpoint is cut short")
    ap.add_argument("--no-follower", dest="follower", action="store_false",
                    help="no CPU follower (it stands in for a Mac worker's reconstruction; its host copy of the plane "
                    "beside the learner's offloaded state is more than the one-GPU H200's 128 GiB host holds at 24 "
                    "layers); the cold join still checks the last version bit-exact")
    ap.add_argument("--no-kill", action="store_true", help="skip the kill-and-resume (the first plane's, by default)")
    ap.add_argument("--reuse-model", action="store_true", help="keep --root and its model from an earlier call "
                    "(a device call's time limit splits the planes and the kill over several calls)")
    ap.add_argument("--root", default=str(ROOT))
    ap.add_argument("--out", default=str(RESULTS / "lfm2_loop.json"))
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.max_new_tokens, args.batch_groups, args.worker_threads = 4, min(args.max_new_tokens, 8), 2, 1
    root = Path(args.root)
    if not args.reuse_model:
        shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DRL_MIN_FREE_GB", "20")
    os.environ.setdefault("DRL_RAY_DASHBOARD", "0")
    result: dict = {**provenance(), "command": command(argv, "bench.lfm2_loop"), "machine": machine_info(),
                    "args": vars(args), "workers_note": f"{args.workers} reference workers on the {args.worker_device}, "
                    f"bench coin task, {args.max_new_tokens} new tokens per episode"}
    t0 = time.monotonic()
    built = root / "model" / "bench_model.json"
    if args.reuse_model and built.exists():
        model = json.loads(built.read_text())
    else:
        model = build_model(root / "model", args.layers, args.tiny, args.device)
        model["build_s"] = round(time.monotonic() - t0, 1)
        built.write_text(json.dumps(model))
    _log(f"model: {model['params'] / 1e9:.3f} B parameters in {model['build_s']} s")
    result["model"], out = model, Path(args.out)
    for i, plane in enumerate(p for p in args.planes.split(",") if p):
        try:
            result[plane] = run_plane(args, plane, model, kill=i == 0 and not args.no_kill,
                                      record=lambda figures, plane=plane: _write(out, {**result, plane: figures}))
        except Exception as e:  # one plane's failure is reported; the next still runs
            import traceback

            result[plane] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        _write(out, result)
        _log(f"{plane}: " + json.dumps({k: v for k, v in result[plane].items() if not isinstance(v, list | dict | str)}))
    return 0 if all("error" not in result[p] for p in args.planes.split(",") if p) else 1


if __name__ == "__main__":
    sys.exit(main())
