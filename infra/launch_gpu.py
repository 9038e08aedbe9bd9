"""The real trainer on a GPU box: one sequence of idempotent steps, reached directly or over SSH.

`make gsm8k RUN=<id>` on a GPU box with R2 credentials (and no HOST) calls `launch_on_this_box`; with
`HOST=user@box` the tree is shipped and `python3 -m infra.launch_gpu --recipe-json ...` runs this same
function on the box (infra/remote). Each step can run again: it checks what is already there first.
These are the slime engine's steps; `train.engine: native` runs infra/native_launch.py's.
More in docs/quickstart-gpu.md (module notes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainer.config import REPO_ROOT, RecipeConfig

from .launch_plan import LaunchPlan, LaunchStep, remote_steps, render_plan
from .slime_launch import (
    KNOWN_HF_CONFIGS,
    BoxPaths,
    TrainerOnly,
    detect_trainer_only,
    launch_command,
    rotary_base,
)
from .steps import StepFailed, run_command, run_steps

REMOTE_STEPS = remote_steps(
    check_box="nvidia-smi, ~100 GB free, slime/Megatron-LM dirs, Python imports (infra/box_check.py)",
    install_deps="pip-install only the contract's missing dependencies")
BOX_STEPS = [
    LaunchStep(name="check_box", where="box", gpu_only=True, summary="the same checks, on the box itself"),
    LaunchStep(name="write_recipe", where="box", summary="resolved recipe to <state>/recipe.json for the plugin"),
    LaunchStep(name="download_model", where="box", gpu_only=True,
               summary="huggingface_hub.snapshot_download into .stoa/models (skips what it has)"),
    LaunchStep(name="convert_model", where="box", gpu_only=True,
               summary="python -m infra.convert with --rotary-base = HF rope_theta (skipped if converted)"),
    LaunchStep(name="apply_patches", where="box", gpu_only=True,
               summary="infra/patches onto slime; refused if the box's slime does not fit"),
    LaunchStep(name="publish_anchor", where="box", gpu_only=True,
               summary="run.json (create or identical resume) and the base as the v1 anchor"),
    LaunchStep(name="start_ray", where="box", gpu_only=True,
               summary="ray start --head --dashboard-host 127.0.0.1 (skipped if Ray is up)"),
    LaunchStep(name="launch_trainer", where="box", gpu_only=True,
               summary="setsid ray job submit ... train.py, log to logs/<run>.log, pid file (skipped if alive)"),
]


# -- the plan -------------------------------------------------------------------------------------------
def contract_env(cfg: RecipeConfig, env: Mapping[str, str], store: str) -> dict[str, str]:
    """The env contract values of this launch, secrets replaced by asterisks (safe to print)."""
    from worker_contract.env import R2_VARS, REDACTED, SECRET_VARS

    out = {"DRL_RUN": cfg.run or "", "DRL_N_SAMPLES": str(cfg.contract.n_samples),
           "DRL_PULSE_PLANE": cfg.contract.plane, "DRL_STORE": store}
    if cfg.contract.kv_mode:
        out["DRL_KV_MODE"] = cfg.contract.kv_mode
    for var in R2_VARS:
        if env.get(var):
            out[var] = REDACTED if var in SECRET_VARS else env[var]
    return out


def hf_config_for(cfg: RecipeConfig, paths: BoxPaths) -> tuple[dict[str, Any] | None, str]:
    """The model's config.json if it is on this machine, else the built-in facts; and where it came from."""
    candidate = Path(paths.hf_dir(cfg.model.hf_id)) / "config.json"
    if candidate.is_file():
        from trainer.models.hf_io import load_hf_config

        return load_hf_config(candidate.parent), str(candidate)  # not JSON, not an object: one sentence naming it
    if cfg.model.hf_id in KNOWN_HF_CONFIGS:
        return dict(KNOWN_HF_CONFIGS[cfg.model.hf_id]), (
            f"built-in architecture facts of {cfg.model.hf_id} (on the box: the downloaded config.json)")
    return None, f"{candidate} (not on this machine)"


def build_plan(cfg: RecipeConfig, *, host: str | None, remote_dir: str, env: Mapping[str, str], store: str,
               trainer_only: TrainerOnly | None = None) -> LaunchPlan:
    """The resolved launch (no side effects): what the dry run prints and the real launch follows.

    `trainer_only` None: read it off the slime tree when it is on this machine (on the box), else
    `--rollout-num-gpus 0`, which the box's own launch re-checks.
    """
    if not cfg.run:
        raise ValueError("DRL_RUN is not set: choose a fresh run id, e.g. make gsm8k RUN=gsm8k-2026-12-01a")
    paths = BoxPaths(remote_dir=remote_dir, run=cfg.run, model_dir_override=cfg.model.path)
    if cfg.train.engine == "native":
        return _native_plan(cfg, paths, host=host, env=env, store=store)
    hf_config, source = hf_config_for(cfg, paths)
    detected = None if (trainer_only or host) else detect_trainer_only(cfg.launch.slime_dir)
    trainer_only = trainer_only or detected or "rollout-num-gpus-0"
    why = ("slime has PR #2057: with no engine the weight push is skipped and the router stays for eval"
           if trainer_only == "rollout-num-gpus-0" else
           "this slime predates PR #2057, so no SGLang at all; slime's eval() is then a no-op")
    notes = [f"model flags from {source}",
             f"trainer-only mode: {trainer_only} ({why}; "
             + (f"read from {cfg.launch.slime_dir})" if detected else "checked on the box at launch)"),
             "staleness and reuse are enforced by the plugin's bucket rollout source "
             f"(bound {cfg.algo.staleness}, cap {cfg.algo.reuse_cap}), not by a slime flag"]
    if hf_config is None:
        args = slime_args_without_model(cfg, paths, trainer_only)
        command = ["<model flags unresolved>"] + args
        notes.append("the launch refuses until the model's config.json is readable on the box")
    else:
        rotary_base(cfg, hf_config)  # a recipe value that differs from rope_theta is refused outright
        try:
            command = launch_command(cfg, paths, hf_config, trainer_only=trainer_only)
            args = command[command.index("--") + 3:]
        except ValueError as e:  # an architecture without Megatron flags: say so, show the rest
            args = slime_args_without_model(cfg, paths, trainer_only)
            command = ["<model flags unresolved>"] + args
            notes.append(f"cannot launch yet: {e}")
    if store.startswith("file://"):
        notes.append("DRL_STORE is a file store: workers on other machines cannot reach it")
    box = BOX_STEPS
    from . import psqa_setup

    if psqa_setup.applies(cfg):  # the fleet reference pulls its converted base from the bucket
        box = psqa_setup.plan_steps(BOX_STEPS)
    steps = (REMOTE_STEPS if host else []) + box
    return LaunchPlan(run=cfg.run, recipe=cfg.model_dump(mode="json"), env=contract_env(cfg, env, store),
                      command=command, slime_args=args, host=host, remote_dir=remote_dir,
                      log_file=paths.log_file, steps=steps, notes=notes)


def _native_plan(cfg: RecipeConfig, paths: BoxPaths, *, host: str | None, env: Mapping[str, str],
                 store: str) -> LaunchPlan:
    from . import native_launch as nl

    hf_config, source = hf_config_for(cfg, paths)
    if hf_config is not None and cfg.model.rotary_base is not None:
        rotary_base(cfg, hf_config)  # a recipe value that differs from rope_theta is refused outright
        # (the learner reads the HF config itself; create_run checks the model's identity again)
    notes = [f"model facts from {source}", *nl.plan_notes(cfg)]
    if store.startswith("file://"):
        notes.append("DRL_STORE is a file store: workers on other machines cannot reach it")
    python = "python3" if host else sys.executable
    return LaunchPlan(run=cfg.run, recipe=cfg.model_dump(mode="json"), env=contract_env(cfg, env, store),
                      command=nl.learner_command(cfg, paths, python), slime_args=[], host=host,
                      remote_dir=paths.remote_dir, log_file=paths.log_file,
                      steps=(nl.NATIVE_REMOTE_STEPS if host else []) + nl.NATIVE_BOX_STEPS, notes=notes)


def slime_args_without_model(cfg: RecipeConfig, paths: BoxPaths, trainer_only: TrainerOnly) -> list[str]:
    from . import slime_launch as sl

    return [*sl.cluster_args(cfg, trainer_only), *sl.checkpoint_args(cfg, paths), *sl.rollout_args(cfg),
            *sl.objective_args(cfg), *sl.optimizer_args(cfg), *sl.perf_args(cfg), *cfg.launch.extra_args]


def resolve_store(cfg: RecipeConfig, env: Mapping[str, str]) -> str:
    from worker_contract.env import default_store_url

    return cfg.store or default_store_url(env, REPO_ROOT)


# -- the steps ------------------------------------------------------------------------------------------
def step_check_box(cfg: RecipeConfig, paths: BoxPaths) -> str:
    from . import box_check

    report = box_check.run_checks(paths.remote_dir, cfg.launch.slime_dir, cfg.launch.megatron_dir)
    if not report["ok"]:
        raise StepFailed("check_box:\n" + "\n".join(f"  {k}: {v['error']}" for k, v in report.items()
                                                     if isinstance(v, dict) and not v["ok"]))
    gpus = ", ".join(f"{g['name']} ({g['memory_mib'] // 1024} GiB, driver {g['driver']})" for g in report["gpu"]["gpus"])
    slime = report.get("slime")
    return f"{gpus}; {report['disk']['free_gb']} GB free" + (
        f"; slime {slime['commit']} {slime.get('date', '')}".rstrip() if slime else "")


def step_write_recipe(cfg: RecipeConfig, paths: BoxPaths) -> str:
    target = Path(paths.recipe_file)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
    if target.exists() and target.read_text() == text:
        return "unchanged"
    tmp = target.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(target)
    return str(target)


def step_download_model(cfg: RecipeConfig, paths: BoxPaths) -> str:
    hf_dir = Path(paths.hf_dir(cfg.model.hf_id))
    if cfg.model.path:
        if not (hf_dir / "config.json").is_file():
            raise StepFailed(f"download_model: MODEL={hf_dir} has no config.json; point MODEL at an HF model dir")
        return f"using {hf_dir}"
    from huggingface_hub import snapshot_download

    snapshot_download(repo_id=cfg.model.hf_id, local_dir=str(hf_dir))
    return str(hf_dir)


def step_convert_model(cfg: RecipeConfig, paths: BoxPaths) -> str:
    from infra.convert_tasks import convert_command
    from trainer.models import check_model_identity, identity_from_hf, read_identity

    hf_dir, out = paths.hf_dir(cfg.model.hf_id), paths.torch_dist_dir(cfg.model.hf_id)
    hf = identity_from_hf(hf_dir)
    check_model_identity(hf, rotary_base=cfg.model.rotary_base, rotary_base_source="recipe model.rotary_base")
    if (Path(out) / "latest_checkpointed_iteration.txt").is_file():
        check_model_identity(hf, checkpoint=read_identity(out))
        return f"already converted at {out} (identity checked)"
    cmd = convert_command(hf_dir, out, rotary_base=hf.rope_theta, dtype=cfg.model.dtype, overwrite=True)
    run_command("convert_model", cmd, {**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    return f"{out} (rotary base {hf.rope_theta:g})"


def step_apply_patches(cfg: RecipeConfig, paths: BoxPaths) -> str:
    from .patches.apply import PatchRefused, apply_patches, summary, tree_commit

    lines: list[str] = []
    try:
        states = apply_patches(cfg.launch.slime_dir, log=lines.append)
    except PatchRefused as e:
        raise StepFailed(f"apply_patches: {e}") from None
    return f"slime {tree_commit(Path(cfg.launch.slime_dir))}: {summary(states)}"


def step_publish_anchor(cfg: RecipeConfig, paths: BoxPaths) -> str:
    from .anchor import publish_base_anchor

    return publish_base_anchor(cfg, paths)


def step_start_ray(cfg: RecipeConfig, paths: BoxPaths) -> str:
    if subprocess.run(["ray", "status"], capture_output=True, check=False).returncode == 0:
        return "Ray is already up"
    run_command("start_ray", ["ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1",
                       "--dashboard-port", "8265", "--num-gpus", str(cfg.compute.tensor_parallel),
                       "--disable-usage-stats"])
    marker = Path(paths.remote_dir) / ".stoa" / "ray.started"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("started by infra.launch_gpu\n")
    return "Ray head on 127.0.0.1, dashboard http://127.0.0.1:8265 (localhost only)"


def step_launch_trainer(cfg: RecipeConfig, paths: BoxPaths, plan: LaunchPlan) -> str:
    from .boxops import alive_pid, start_detached

    pid = alive_pid(paths.pid_file)
    if pid is not None:
        return f"trainer already running (pid {pid}); log {paths.log_file}"
    pid = start_detached(plan.command, log_file=paths.log_file, pid_file=paths.pid_file, cwd=cfg.launch.slime_dir)
    return f"pid {pid}, log {paths.log_file} (follow: invoke logs --run {cfg.run} --follow)"


def launch_on_this_box(cfg: RecipeConfig, *, dry_run: bool = False, out: Callable[[str], None] = print,
                       err: Callable[[str], None] | None = None) -> int:
    """Stand the trainer up on this GPU box (the tree's own directory is the remote dir); 0 on success."""
    from worker_contract.env import load_env

    env = load_env(repo_root=REPO_ROOT)
    plan = build_plan(cfg, host=None, remote_dir=str(REPO_ROOT), env=env, store=resolve_store(cfg, env))
    if dry_run:
        out(render_plan(plan))
        return 0
    paths = BoxPaths(remote_dir=str(REPO_ROOT), run=plan.run, model_dir_override=cfg.model.path)
    cfg = cfg.model_copy(update={"store": plan.env["DRL_STORE"]})
    if cfg.train.engine == "native":
        return run_steps(native_steps(cfg, paths, out), out, err=err)
    steps: list[tuple[str, Callable[[], str]]] = [
        ("check_box", lambda: step_check_box(cfg, paths)),
        ("write_recipe", lambda: step_write_recipe(cfg, paths)),
        ("download_model", lambda: step_download_model(cfg, paths)),
        ("convert_model", lambda: step_convert_model(cfg, paths)),
        ("apply_patches", lambda: step_apply_patches(cfg, paths)),
        ("publish_anchor", lambda: step_publish_anchor(cfg, paths)),
        ("start_ray", lambda: step_start_ray(cfg, paths)),
        ("launch_trainer", lambda: _launch_with_fresh_plan(cfg, paths, env)),
    ]
    from . import psqa_setup

    if psqa_setup.applies(cfg):
        steps = psqa_setup.run_steps_for(cfg, paths, steps)
    return run_steps(steps, out, err=err)


def native_steps(cfg: RecipeConfig, paths: BoxPaths, out: Callable[[str], None]) -> list[tuple[str, Callable[[], str]]]:
    """The native engine's on-box steps (infra/native_launch.py), sharing write_recipe and download_model."""
    from . import native_launch as nl

    return [
        ("check_box", lambda: nl.step_check_box(cfg, paths)),
        ("install_packages", lambda: nl.step_install_packages()),
        ("write_recipe", lambda: step_write_recipe(cfg, paths)),
        ("download_model", lambda: step_download_model(cfg, paths)),
        ("publish_run", lambda: nl.step_publish_run(cfg, paths)),
        ("launch_learner", lambda: nl.step_launch_learner(cfg, paths)),
        ("wait_learner", lambda: nl.step_wait_learner(cfg, paths, log=out)),
    ]


def _launch_with_fresh_plan(cfg: RecipeConfig, paths: BoxPaths, env: Mapping[str, str]) -> str:
    """Rebuild the command now that config.json is on disk, refuse if model flags are still unknown."""
    plan = build_plan(cfg, host=None, remote_dir=paths.remote_dir, env=env, store=cfg.store or "")
    if plan.command[0] != "ray":
        raise StepFailed("launch_trainer: " + "; ".join(n for n in plan.notes if "cannot launch" in n
                                                         or "refuses" in n))
    return step_launch_trainer(cfg, paths, plan)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="stand up the trainer on this GPU box (the remote entry point)")
    ap.add_argument("--recipe-json", required=True, help="a resolved RecipeConfig as JSON (written by infra/remote)")
    ap.add_argument("--dry-run", action="store_true", help="print the resolved plan; change nothing")
    args = ap.parse_args(argv)
    from worker_contract.env import env_bool

    if not Path(args.recipe_json).is_file():
        raise ValueError(f"--recipe-json {args.recipe_json} is not a file (infra/remote writes it on the box)")
    cfg = RecipeConfig.model_validate_json(Path(args.recipe_json).read_text())
    dry = args.dry_run or env_bool("DRL_DRY_RUN", os.environ.get("DRL_DRY_RUN", ""))
    return launch_on_this_box(cfg, dry_run=dry,
                              out=lambda m: print(m, flush=True), err=lambda m: print(m, file=sys.stderr, flush=True))


if __name__ == "__main__":
    from worker_contract.cli import run_main

    sys.exit(run_main(main, "python -m infra.launch_gpu"))
