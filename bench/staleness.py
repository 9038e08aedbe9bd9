"""`python -m bench.staleness`: does the objective keep learning when every group is k versions old?

Held-out accuracy after a fixed number of learner steps, per forced staleness k and objective (`recipe`,
`ppo`, `no_is`), each cell a lock-step run of the real pieces in its own file bucket.

    python -m bench.staleness --preset power --seeds 5 --jobs 16   # the sweep with power (docs/performance.md)
    python -m bench.staleness --preset gpu --jobs 8            # the 25 M model on one GPU, 8 cells at a time
    python -m bench.staleness --preset cpu --lags 0,4,16 --seeds 3
More in docs/performance.md (module notes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from embedded.config import EmbeddedBaseConfig, resolve_embedded
from trainer.config import RecipeConfig
from worker_contract.cli import number

from . import staleness_stats as stats
from .common import RESULTS, git_commit, machine_info, provenance

REPO = Path(__file__).resolve().parent.parent
#: the built-in objectives (trainer/objectives.py's registry), the recipe's first
OBJECTIVES: tuple[str, ...] = ("recipe", "ppo", "no_is")
DEFAULT_LAGS = (0, 1, 2, 4, 8, 16)


class Preset(BaseModel):
    """How large a sweep's cells are: the base built on the spot, the recipe's values, the budget."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: EmbeddedBaseConfig | None = None
    """The base model to build (None = the recipe's embedded base)."""
    sft_candidates: tuple[int, ...] = ()
    """Supervised step counts to try for the base (each a cached base of its own): the sweep takes the one
    whose validation accuracy (training problems it never saw; never the test split) is nearest the middle
    of `sft_target_accuracy`, so RL has signal and room whatever the model's size (empty: `base.sft_steps`
    as it is)."""
    recipe: dict[str, Any] = {}
    """Dotted recipe values on top of the GSM8K recipe's embedded ones."""
    steps: int
    """Learner steps per cell."""
    eval_every: int
    """Held-out evaluation every this many steps (0 = only at the start and the end)."""
    eval_problems: int
    """Held-out problems per evaluation."""
    device: str = "cpu"
    """Where the learner, the worker and the evaluation run."""
    threads: int = 1
    """torch CPU threads per cell process."""


PRESETS: dict[str, Preset] = {
    # the CPU test: machinery only (an untrained 2-layer model; accuracy means nothing)
    "smoke": Preset(
        base=EmbeddedBaseConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                vocab_size=300, tokenizer_corpus=200, sft_steps=2, sft_batch_size=4),
        recipe={"algo.groups_per_step": 2, "contract.n_samples": 4, "algo.max_new_tokens": 8,
                "compute.micro_batch_size": 8, "train.anchor_interval": 4},
        steps=3, eval_every=0, eval_problems=4),
    # the embedded run's own base and recipe on the CPU (0.85 M parameters: it plateaus within ~20 steps)
    "cpu": Preset(steps=40, eval_every=10, eval_problems=200),
    # the sweep with power: the embedded recipe's shipped base (24.5% held-out), which RL lifts by 25-30 points
    # within 30 steps, at lr 1e-4 (3.3x the recipe's), so the policy moves far enough per version that PPO's
    # clip range acts on stale groups; float32 on one CPU core per cell (on CUDA the workers would sample this
    # width-128 model in bf16, another model: docs/embedded.md), 16 cells at a time on a 16-core box
    "power": Preset(recipe={"optim.lr": 1e-4}, steps=30, eval_every=5, eval_problems=400),
    # a base large enough that staleness shows (25 M parameters), built and supervised on the GPU; few, wide
    # layers, because a step of this size is launch-bound: its time goes with the number of layers
    "gpu": Preset(
        base=EmbeddedBaseConfig(hidden_size=768, num_layers=4, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                                vocab_size=512, sft_steps=250, sft_batch_size=64, sft_lr=1e-3),
        sft_candidates=(60, 120, 250, 500),
        recipe={"optim.lr": 1e-5, "compute.micro_batch_size": 64},
        steps=50, eval_every=25, eval_problems=300, device="cuda", threads=1),
}


@dataclass(frozen=True)
class Cell:
    objective: str
    lag: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.objective}-k{self.lag}-s{self.seed}"


def cell_recipe(cell: Cell, preset: Preset, base_dir: str | Path, sets: dict[str, Any] | None = None) -> RecipeConfig:
    """The recipe one cell trains with: the GSM8K embedded recipe, the preset's values, then the cell's
    objective, a staleness bound that admits the forced lag (max(k, the recipe's)), each group used once (so
    its age is exactly k) and the cell's seed. `sets` (dotted values) wins over the preset's."""
    overrides = {**preset.recipe, **(sets or {}), "model.path": None}
    cfg = resolve_embedded("gsm8k", env={}, overrides=overrides)
    algo = cfg.algo.model_copy(update={"objective": cell.objective, "staleness": max(cell.lag, cfg.algo.staleness),
                                       "reuse_cap": 1})
    train = cfg.train.model_copy(update={"num_steps": preset.steps, "seed": cell.seed})
    model = cfg.model.model_copy(update={"path": str(base_dir), "hf_id": None})
    return cfg.model_copy(update={"run": cell.name, "store": None, "algo": algo, "train": train, "model": model})


class _Heldout:
    """Greedy accuracy of the newest published version, read back through a verifying reconstructor."""

    def __init__(self, store, cfg: RecipeConfig, base_dir: str, problems: int, device: str, threads: int):
        from worker_contract.reconstruct import Reconstructor
        from worker_contract.tasks import get_task
        from worker_contract.worker.model import PolicyModel

        self.rec = Reconstructor(store, cfg.run, plane=cfg.contract.plane)
        self.policy = PolicyModel(base_dir, threads=threads, device=device)
        self.task = get_task(cfg.task)
        self.problems = list(self.task.dataset("test")[:problems])
        self.max_new_tokens, self.plane = cfg.algo.max_new_tokens, cfg.contract.plane

    def __call__(self) -> tuple[int, float]:
        from embedded.basemodel import evaluate
        from worker_contract.planes import get_plane

        self.rec.follow()
        self.policy.load(get_plane(self.plane).to_dense(self.rec.state))
        acc = evaluate(self.policy.model, self.policy.tokenizer, self.task, self.problems,
                       max_new_tokens=self.max_new_tokens)
        return self.rec.version, acc


def run_cell(cell: Cell, preset: Preset, base_dir: str, work: str, sets: dict[str, Any] | None = None) -> dict:
    """One lock-step run; returns what it measured, with every used group's version (the lag evidence)."""
    import torch
    from transformers.utils import logging as hf_logging

    from trainer.backends import get_backend
    from trainer.run_init import create_run
    from trainer.session import LearnerSession, RolloutSide
    from trainer.step import train_on
    from worker_contract.store import open_store
    from worker_contract.tasks import get_task
    from worker_contract.worker.loop import Worker, WorkerSettings

    hf_logging.disable_progress_bar()  # "Loading weights" bars would drown the progress lines
    t0 = time.monotonic()
    torch.set_num_threads(preset.threads)
    torch.manual_seed(cell.seed)
    cfg = cell_recipe(cell, preset, base_dir, sets)
    root = Path(work) / f"{cell.name}-{os.getpid()}"  # two sweeps sharing --work never share a bucket
    shutil.rmtree(root, ignore_errors=True)  # a cell's own scratch bucket, from an interrupted attempt
    url = f"file://{(root / 'bucket').resolve()}"
    store = open_store(url)
    run = create_run(cfg, store, base_dir, root / "trainer.key", publish_base=False)
    manifest, key = run.manifest, run.key
    backend = get_backend(cfg.train.backend).load(base_dir, cfg, device=preset.device)
    # the learner's parts as the native learner wires them (trainer/session.py); publishing in lock-step
    session = LearnerSession(cfg, store, manifest, key, progress=False)
    side = RolloutSide(store, manifest, cfg.algo, poll_interval_s=0.05)
    base_state = backend.state_dict_hf()
    version = session.publish_start(base_state, side.counts())
    for _ in range(cell.lag):  # versions 1..k+1 hold the base: groups are k versions old from step 1 on
        version = session.publishing.publish_now(base_state, 0, session.report(None, counts=side.counts())).version
    env = {"DRL_N_SAMPLES": str(cfg.contract.n_samples), "DRL_PULSE_PLANE": cfg.contract.plane,
           "DRL_TRAINER_KEY_FINGERPRINT": run.fingerprint}
    worker = Worker(WorkerSettings(store=url, run=cfg.run, model_dir=str(base_dir), worker_id=f"lag{cell.lag}",
                                   seed=cell.seed, threads=preset.threads, lag_versions=cell.lag), env=env)
    if not worker.setup(threading.Event()):
        raise RuntimeError(f"{cell.name}: the worker did not join")
    heldout = _Heldout(store, cfg, str(base_dir), preset.eval_problems, preset.device, preset.threads)
    train = get_task(cfg.task).dataset("train")
    rng = random.Random(f"staleness-prompts:{cell.seed}")  # the same prompts for every cell of a seed
    audit = session.audit  # groups sampled at the learner's own weights (k = 0): worker vs learner log-probs
    _, base_acc = heldout()
    curve: list[list[float]] = [[0, base_acc]]
    steps: list[dict] = []
    clock = {"setup_s": time.monotonic() - t0, "sync_s": 0.0, "sample_s": 0.0, "train_s": 0.0, "publish_s": 0.0,
             "eval_s": 0.0}

    def tick(key: str, since: float) -> float:
        now = time.monotonic()
        clock[key] += now - since
        return now

    for step in range(1, preset.steps + 1):
        t = time.monotonic()
        held = worker.sync()
        t = tick("sync_s", t)
        problems = [train[rng.randrange(len(train))] for _ in range(cfg.algo.groups_per_step)]
        for record in worker.sample_groups(problems):
            worker.upload(record)
        t = tick("sample_s", t)
        got = side.next_batch(version, timeout_s=0.0)
        if got is None or len(got[0].groups) != cfg.algo.groups_per_step:
            raise RuntimeError(f"{cell.name} step {step}: the source assembled no full batch "
                               f"(drops {dict(side.source.drops)})")
        batch, note = got
        # the native step (trainer/step.py); lock-step publishing: `version` holds exactly these weights
        m = train_on(backend, [g.record for g in batch.groups], cfg.algo, audit, version)
        steps.append({
            "step": step, "learner_version": version, "worker_version": held,
            "group_versions": [g.record.policy_version for g in batch.groups],
            "uses": [g.use for g in batch.groups],
            "reward": batch.metrics["rollout/raw_reward"],
            **{k: round(float(m[k]), 6) for k in ("gate_drop_frac", "clip_low_frac", "clip_high_frac",
                                                   "clip_dual_frac", "ratio_max", "ratio_min", "kl_mean")
               if k in m},
        })
        t = tick("train_s", t)
        session.step = step
        version = session.publishing.publish_now(backend.state_dict_hf(), step, session.report(note, m)).version
        t = tick("publish_s", t)
        if step == preset.steps or (preset.eval_every and step % preset.eval_every == 0):
            evaluated, acc = heldout()
            assert evaluated == version, (evaluated, version)
            curve.append([step, acc])
            tick("eval_s", t)
    session.close()
    lags = sorted({s["learner_version"] - v for s in steps for v in s["group_versions"]})
    if lags != [cell.lag]:  # the cell measures nothing if its groups were not exactly k versions old
        raise RuntimeError(f"{cell.name}: the learner used groups {lags} versions old, not {cell.lag}")
    rewards = [s["reward"] for s in steps]
    tail = rewards[-max(1, len(rewards) // 4):]
    shutil.rmtree(root, ignore_errors=True)
    return {
        "cell": cell.name, "objective": cell.objective, "lag": cell.lag, "seed": cell.seed, "commit": git_commit(),
        "steps": preset.steps, "base_accuracy": base_acc, "final_accuracy": curve[-1][1],
        "last3_accuracy": stats.last3(curve), "best_accuracy": max(a for _, a in curve[1:]), "curve": curve,
        "lags_seen": lags, "train_reward_last_quarter": sum(tail) / len(tail),
        **stats.cell_fractions(steps, cell.objective), "time_s": {k: round(v, 2) for k, v in clock.items()},
        "gate_drop_frac_mean": _mean(s.get("gate_drop_frac") for s in steps),
        "ratio_max": max((s.get("ratio_max", 0.0) for s in steps), default=0.0),
        "audit": audit.metrics(), "drops": dict(side.source.drops), "wall_s": round(time.monotonic() - t0, 1), "per_step": steps,
        "staleness_bound": cfg.algo.staleness, "reuse_cap": cfg.algo.reuse_cap, "lr": cfg.optim.lr,
    }


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def build_base(preset: Preset, work: Path, log=print) -> tuple[str, dict]:
    """The preset's base (built once, cached under `work`/cache), and what building it measured."""
    from embedded.basemodel import ensure_base
    from worker_contract.tasks import get_task

    cfg = resolve_embedded("gsm8k", env={}, overrides=preset.recipe)
    base_cfg = preset.base or cfg.embedded.base
    reports, val = [], {}
    lo, hi = base_cfg.sft_target_accuracy
    task = get_task(cfg.task)
    for steps in sorted(preset.sft_candidates) or (base_cfg.sft_steps,):
        if reports and val[reports[-1].path] >= (lo + hi) / 2:
            break  # more supervision only raises it further
        candidate = base_cfg.model_copy(update={"sft_steps": steps})
        report = ensure_base(candidate, task, work / "cache", max_new_tokens=cfg.algo.max_new_tokens,
                             eval_problems=preset.eval_problems, log=log, device=preset.device)
        reports.append(report)
        # the candidate is chosen on validation problems, never on the test split the cells report
        val[report.path] = (_validation_accuracy(report.path, task, preset, cfg.algo.max_new_tokens)
                            if preset.sft_candidates else report.heldout_accuracy)
        if preset.sft_candidates:
            log(f"base candidate: {steps} supervised steps, validation {100 * val[report.path]:.1f}%, "
                f"held-out {100 * report.heldout_accuracy:.1f}%")
    best = min(reports, key=lambda r: abs(val[r.path] - (lo + hi) / 2))
    if not lo <= val[best.path] <= hi:
        log(f"warning: the base's accuracy {100 * val[best.path]:.1f}% is outside "
            f"{100 * lo:.0f}-{100 * hi:.0f}%: RL has {'little signal' if val[best.path] < lo else 'little room'}")
    return best.path, {**best.model_dump(), "chosen_on": "validation" if preset.sft_candidates else "fixed steps",
                       "validation_accuracy": val[best.path] if preset.sft_candidates else None,
                       "candidates": [[r.sft_steps, r.heldout_accuracy, val[r.path]] for r in reports]}


def _validation_accuracy(path: str, task, preset: Preset, max_new_tokens: int) -> float:
    """Greedy accuracy of a base on bench.common.validation_problems (as many as the preset's held-out)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from embedded.basemodel import evaluate

    from .common import validation_problems

    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").to(preset.device)
    return evaluate(model, AutoTokenizer.from_pretrained(path), task, validation_problems(task, preset.eval_problems),
                    max_new_tokens=max_new_tokens)


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(_usage(f"--{what} takes comma-separated integers, got {text!r}")) from None
    if not vals or any(v < 0 for v in vals):
        raise SystemExit(_usage(f"--{what} needs at least one integer >= 0, got {text!r}"))
    return vals


def _usage(msg: str) -> int:
    print(f"bench.staleness: {msg}", file=sys.stderr)
    return 2


def _parse_sets(items: list[str]) -> dict[str, Any]:
    import yaml

    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(_usage(f"--set takes dotted.key=value, got {item!r}"))
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)  # a crash never leaves a torn results file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.staleness", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu", help=f"cell size: {', '.join(PRESETS)} (default cpu)")
    ap.add_argument("--objectives", default=",".join(OBJECTIVES), help="comma-separated algo.objective values")
    ap.add_argument("--lags", default=",".join(map(str, DEFAULT_LAGS)), help="forced staleness values k")
    ap.add_argument("--seeds", type=number(int, at_least=1), default=3, help="seeds per cell (0..N-1; default 3)")
    ap.add_argument("--steps", type=number(int, at_least=1), default=None, help="learner steps per cell (default: the preset's)")
    ap.add_argument("--jobs", type=number(int, at_least=1), default=1, help="cells run at once, one process each (default 1)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe value for every cell, e.g. optim.lr=2e-5 (repeatable)")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results/staleness_<preset>.json)")
    ap.add_argument("--figure", type=Path, default=None, help="PNG (default docs/staleness_<preset>.png)")
    ap.add_argument("--work", type=Path, default=REPO / ".stoa" / "staleness", help="scratch buckets and base cache")
    ap.add_argument("--fresh", action="store_true", help="start the results file over instead of adding to it")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure and table from --out, run nothing")
    ap.add_argument("--budget-s", type=number(float, above=0), default=None,
                    help="start no cell after this many seconds (cells in flight finish; a rerun adds the rest)")
    args = ap.parse_args(argv)
    if args.preset not in PRESETS:
        return _usage(f"unknown preset {args.preset!r}; known: {', '.join(PRESETS)}")
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    unknown = [o for o in objectives if o not in OBJECTIVES]
    if unknown or not objectives:
        return _usage(f"unknown objective(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(OBJECTIVES)}")
    if args.seeds < 1 or args.jobs < 1 or (args.steps is not None and args.steps < 1):
        return _usage("--seeds, --jobs and --steps must be at least 1")
    lags = _parse_ints(args.lags, "lags")
    sets = _parse_sets(args.set)
    preset = PRESETS[args.preset]
    if args.steps:
        preset = preset.model_copy(update={"steps": args.steps})
    out = args.out or RESULTS / f"staleness_{args.preset}.json"
    figure = args.figure or REPO / "docs" / f"staleness_{args.preset}.png"
    if args.plot_only:
        if not out.exists():
            return _usage(f"--plot-only: {out} does not exist")
        draw(json.loads(out.read_text()), figure)
        return 0
    if preset.device == "cpu":  # every cell in float32 on the CPU: the workers would take a GPU (bf16) if seen
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.setdefault("OMP_NUM_THREADS", str(preset.threads))
    if preset.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return _usage(f"preset {args.preset!r} needs a CUDA GPU; this machine has none (use --preset cpu)")
    try:
        cfg0 = cell_recipe(Cell(objectives[0], 0, 0), preset, "base", sets)
    except ValueError as e:
        return _usage(str(e).splitlines()[-1])
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    prov = provenance()  # before anything is written: the tree the cells run from
    print(f"commit {prov['commit']}, tree {'clean' if prov['clean'] else 'NOT clean: ' + prov['status_porcelain']}",
          flush=True)
    print(f"building (or reusing) the {args.preset} base under {work}/cache ...", flush=True)
    base_dir, base_report = build_base(preset, work)
    print(f"base {base_dir}: {base_report['params'] / 1e6:.2f} M parameters, held-out "
          f"{100 * base_report['heldout_accuracy']:.1f}% ({base_report['sft_seconds']:.0f} s to build)", flush=True)
    settings = {"preset": args.preset, "steps": preset.steps, "sets": sets, "base": base_report["config_digest"],
                "groups_per_step": cfg0.algo.groups_per_step, "n_samples": cfg0.contract.n_samples,
                "eval_problems": preset.eval_problems, "lr": cfg0.optim.lr, "backend": cfg0.train.backend}
    doc = {"benchmark": "staleness", "settings": settings, "cells": []}
    if out.exists() and not args.fresh:
        old = json.loads(out.read_text())
        if old.get("settings") != settings:
            return _usage(f"{out} holds a sweep with other settings ({old.get('settings')}); pass --fresh to "
                          "start it over or --out for another file")
        if old.get("provenance", {}).get("commit") != prov["commit"]:
            return _usage(f"{out} holds cells of commit {old.get('provenance', {}).get('commit')}, this tree is "
                          f"{prov['commit']}: one file holds one commit (pass --fresh or another --out)")
        doc = old
    done = {c["cell"] for c in doc["cells"]}
    # seed-major: a sweep cut short by --budget-s still holds whole seeds of every (objective, k)
    todo = [c for c in (Cell(o, k, s) for s in range(args.seeds) for k in sorted(lags, reverse=True)
                        for o in objectives) if c.name not in done]
    print(f"{len(todo)} cells to run ({len(done)} already in {out}), {args.jobs} at a time, "
          f"{preset.steps} steps each", flush=True)
    command = "python -m bench.staleness " + " ".join(sys.argv[1:] if argv is None else argv)
    doc.update(machine=machine_info(), base_model=base_report, provenance=prov, command=command,
               commands=[*doc.get("commands", []), command])
    failures = 0

    def record(result: dict) -> None:
        doc["cells"] = [c for c in doc["cells"] if c["cell"] != result["cell"]] + [result]
        doc["cells"].sort(key=lambda c: (OBJECTIVES.index(c["objective"]), c["lag"], c["seed"]))
        doc["summary"] = stats.summarize(doc["cells"])
        _write(out, doc)
        n = len(doc["cells"])
        print(f"[{n}] {result['cell']}: held-out {100 * result['base_accuracy']:.1f}% -> "
              f"{100 * result['final_accuracy']:.1f}% after {result['steps']} steps, lags {result['lags_seen']}, "
              f"{result['wall_s']:.0f} s", flush=True)

    def over_budget() -> bool:
        return args.budget_s is not None and time.monotonic() - t0 > args.budget_s

    if args.jobs == 1:
        for cell in todo:
            if over_budget():
                print(f"--budget-s {args.budget_s:.0f} s reached: {cell.name} and later cells not started", flush=True)
                break
            try:
                record(run_cell(cell, preset, base_dir, str(work), sets))
            except Exception as e:  # as in the pool: reported, and the other cells still run
                failures += 1
                print(f"cell {cell.name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    else:
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
            queue = list(todo)
            running = {}
            while queue or running:
                while queue and len(running) < args.jobs and not over_budget():
                    cell = queue.pop(0)
                    running[pool.submit(run_cell, cell, preset, base_dir, str(work), sets)] = cell
                if queue and over_budget():
                    print(f"--budget-s {args.budget_s:.0f} s reached: {len(queue)} cells not started", flush=True)
                    queue = []
                if not running:
                    break
                fut = next(as_completed(running))
                cell = running.pop(fut)
                try:
                    record(fut.result())
                except Exception as e:  # one broken cell is reported; the others still land in the file
                    failures += 1
                    print(f"cell {cell.name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    doc["wall_s_last_call"] = round(time.monotonic() - t0, 1)
    if doc["cells"]:
        doc["summary"] = stats.summarize(doc["cells"])
        _write(out, doc)
        draw(doc, figure)
        print(f"results {out}; figure {figure}", flush=True)
    return 1 if failures else 0


def draw(doc: dict, figure: Path) -> None:
    """The figure and the table of a results document."""
    s, counts = doc["settings"], [row["final"]["n"] for rows in doc["summary"].values() for row in rows.values()]
    seeds = f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
    title = (f"{s['preset']}: {doc['base_model']['params'] / 1e6:.2f} M-parameter base, {s['steps']} learner steps "
             f"of {s['groups_per_step']}x{s['n_samples']}, lr {s['lr']:g}, {seeds} seeds per point "
             f"(mean, 95% CI; dots = seeds); commit {doc.get('provenance', {}).get('commit', '?')[:7]}")
    stats.plot(doc["summary"], doc["cells"], figure, title, OBJECTIVES)
    print(stats.table(doc["summary"], OBJECTIVES))


if __name__ == "__main__":
    sys.exit(main())
