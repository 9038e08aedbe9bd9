"""The real trainer on a GPU box: one sequence of idempotent steps, reached directly or over SSH.

`make gsm8k RUN=<id>` on a GPU box with R2 credentials (and no HOST) calls `launch_on_this_box`; with
`HOST=user@box` the tree is shipped and `python3 -m infra.launch_gpu --recipe-json ...` runs this same
function on the box (infra/remote). Each step can run again: it checks what is already there first.
These are the slime engine's steps (`SLIME_BOX_STEPS`); `train.engine: native` runs infra/native_launch.py's.
Each step is written once (infra/steps.py `Step`): the dry run's plan and the launch read the same list.
More in docs/quickstart-gpu.md (module notes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from trainer.config import REPO_ROOT, RecipeConfig

from .box_steps import DOWNLOAD_MODEL, WRITE_RECIPE, BoxLaunch, box_report, check_this_box, start_once
from .launch_plan import LaunchPlan, LaunchStep, render_plan
from .slime_launch import (
    BoxPaths,
    TrainerOnly,
    detect_trainer_only,
    hf_config_for,
    launch_command,
    rotary_base,
)
from .steps import Step, StepFailed, bound, plan_of, run_command, run_steps


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
    return LaunchPlan(run=cfg.run, recipe=cfg.model_dump(mode="json"), env=contract_env(cfg, env, store),
                      command=command, slime_args=args, host=host, remote_dir=remote_dir,
                      log_file=paths.log_file, steps=launch_steps(cfg, host), notes=notes)


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
                      remote_dir=paths.remote_dir, log_file=paths.log_file, steps=launch_steps(cfg, host),
                      notes=notes)


def box_steps(cfg: RecipeConfig) -> list[Step]:
    """The on-box launch of this recipe's engine, in order: what the plan lists and what runs."""
    from . import psqa_setup

    if cfg.train.engine == "native":
        from .native_launch import NATIVE_BOX_STEPS

        steps = NATIVE_BOX_STEPS
    else:
        steps = SLIME_BOX_STEPS
    if psqa_setup.applies(cfg):  # the fleet reference pulls its pinned base from the bucket, on either engine
        return psqa_setup.psqa_box_steps(steps, cfg)
    return steps


def launch_steps(cfg: RecipeConfig, host: str | None) -> list[LaunchStep]:
    """The plan's steps: over SSH the remote ones (infra/remote/deploy.py) first, then the box's."""
    from .remote.deploy import remote_steps

    return plan_of((remote_steps(cfg.train.engine) if host else []) + box_steps(cfg))


def slime_args_without_model(cfg: RecipeConfig, paths: BoxPaths, trainer_only: TrainerOnly) -> list[str]:
    from . import slime_launch as sl

    return [*sl.cluster_args(cfg, trainer_only), *sl.checkpoint_args(cfg, paths), *sl.rollout_args(cfg),
            *sl.objective_args(cfg), *sl.optimizer_args(cfg), *sl.perf_args(cfg), *cfg.launch.extra_args]


def resolve_store(cfg: RecipeConfig, env: Mapping[str, str]) -> str:
    from worker_contract.env import default_store_url

    return cfg.store or default_store_url(env, REPO_ROOT)


# -- the steps ------------------------------------------------------------------------------------------
def step_check_box(cfg: RecipeConfig, paths: BoxPaths) -> str:
    report = check_this_box(cfg, paths, "slime")
    answer, slime = box_report(report), report.get("slime")
    return answer + (f"; slime {slime['commit']} {slime.get('date', '')}".rstrip() if slime else "")


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
    return start_once("trainer", plan.command, cfg, paths, cwd=cfg.launch.slime_dir)


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
    return run_steps(bound(box_steps(cfg), BoxLaunch(cfg, paths, env, out)), out, err=err)


def _launch_with_fresh_plan(cfg: RecipeConfig, paths: BoxPaths, env: Mapping[str, str]) -> str:
    """Rebuild the command now that config.json is on disk, refuse if model flags are still unknown."""
    plan = build_plan(cfg, host=None, remote_dir=paths.remote_dir, env=env, store=cfg.store or "")
    if plan.command[0] != "ray":
        raise StepFailed("launch_trainer: " + "; ".join(n for n in plan.notes if "cannot launch" in n
                                                         or "refuses" in n))
    return step_launch_trainer(cfg, paths, plan)


def _step(name: str, summary: str, run: Callable[[BoxLaunch], str], gpu_only: bool = True) -> Step:
    return Step(LaunchStep(name=name, where="box", gpu_only=gpu_only, summary=summary), run)


#: the slime engine's on-box launch, in order (the dry run prints `info`, the launch runs `run`)
SLIME_BOX_STEPS = [
    _step("check_box", "the same checks, on the box itself", lambda b: step_check_box(b.cfg, b.paths)),
    WRITE_RECIPE,
    DOWNLOAD_MODEL,
    _step("convert_model", "python -m infra.convert with --rotary-base = HF rope_theta (skipped if converted)",
          lambda b: step_convert_model(b.cfg, b.paths)),
    _step("apply_patches", "infra/patches onto slime; refused if the box's slime does not fit",
          lambda b: step_apply_patches(b.cfg, b.paths)),
    _step("publish_anchor", "run.json (create or identical resume) and the base as the v1 anchor",
          lambda b: step_publish_anchor(b.cfg, b.paths)),
    _step("start_ray", "ray start --head --dashboard-host 127.0.0.1 (skipped if Ray is up)",
          lambda b: step_start_ray(b.cfg, b.paths)),
    _step("launch_trainer", "setsid ray job submit ... train.py, log to logs/<run>.log, pid file (skipped if alive)",
          lambda b: _launch_with_fresh_plan(b.cfg, b.paths, b.env)),
]


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
