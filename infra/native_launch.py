"""The native engine on a GPU box: our Ray learner (trainer/native/learner.py) on megatron-core, without slime.

Any CUDA box with torch will do (a plain PyTorch image): no slime, no Megatron-LM tree, no custom image.
`infra.launch_gpu` runs these steps when the recipe says `train.engine: native`; each can run again, it
looks first at what is already there.
More in docs/quickstart-gpu.md (module notes).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from trainer.config import RecipeConfig

from .box_steps import DOWNLOAD_MODEL, WRITE_RECIPE, box_report, check_this_box, start_once
from .launch_plan import LaunchStep
from .slime_launch import BoxPaths
from .steps import Step, StepFailed

#: seconds `wait_learner` waits for the learner's first anchor (model load and anchor upload of a 1.5B model)
WAIT_LEARNER_S = 900.0

#: the learner process's module (entrypoints/learner.py), as both launchers start it: `python -m infra.launch_gpu`
#: runs on the box by itself, so it names the learner's main as a command, never imports it
LEARNER_MODULE = "entrypoints.learner"


def learner_argv(python: str, recipe_json: str | Path, model_dir: str | Path, state_dir: str | Path,
                 env_file: str | Path | None = None) -> list[str]:
    """The learner process's command line (entrypoints/learner.py): the native launch's detached learner
    (below) and the embedded run's child (embedded/localprocs.py)."""
    argv = [python, "-m", LEARNER_MODULE, "--recipe-json", str(recipe_json), "--model-dir", str(model_dir),
            "--state-dir", str(state_dir)]
    return argv + (["--env-file", str(env_file)] if env_file is not None else [])


def learner_command(cfg: RecipeConfig, paths: BoxPaths, python: str = sys.executable) -> list[str]:
    """The detached learner's argv (what the dry run prints as the trainer command)."""
    return learner_argv(python, paths.recipe_file, paths.hf_dir(cfg.model.hf_id), paths.state_dir, paths.env_file)


def plan_notes(cfg: RecipeConfig) -> list[str]:
    t, c = cfg.train, cfg.compute
    return [f"engine native: trainer.native.learner on the {t.backend} backend, tensor parallel {c.tensor_parallel} "
            f"(one Ray actor per GPU of this host above 1), micro-batches of {c.max_tokens_per_gpu or '-'} "
            "tokens; ENGINE=slime launches slime's train.py instead (the slime image)",
            "staleness and reuse are enforced by the learner's rollout source "
            f"(bound {cfg.algo.staleness}, cap {cfg.algo.reuse_cap})",
            "Ray runs inside the learner process on 127.0.0.1; its dashboard on 127.0.0.1:8265 only "
            "(DRL_RAY_DASHBOARD=0 turns it off)"]


# -- the steps ------------------------------------------------------------------------------------------
def step_check_box(cfg: RecipeConfig, paths: BoxPaths) -> str:
    report = check_this_box(cfg, paths, "native")
    answer = box_report(report)
    missing = report["imports"].get("installable", [])
    if len(report["gpu"]["gpus"]) < cfg.compute.tensor_parallel:
        raise StepFailed(f"check_box: compute.tensor_parallel={cfg.compute.tensor_parallel} needs that many GPUs on "
                         f"this host; it has {len(report['gpu']['gpus'])}")
    return answer + (f"; to install: {', '.join(missing)}" if missing else "")


def step_install_packages(python: str = sys.executable) -> str:
    from . import box_check

    installed = box_check.ensure_deps(list(box_check.NATIVE_INSTALLABLE.values()), python=python)
    return f"installed {', '.join(installed)}" if installed else "megatron-core and ray present"


def step_publish_run(cfg: RecipeConfig, paths: BoxPaths, env: Mapping[str, str] | None = None) -> str:
    from trainer.run_init import create_run

    from .anchor import open_run_store

    store = open_run_store(cfg, paths, env)
    start = create_run(cfg, store, paths.hf_dir(cfg.model.hf_id), paths.key_file, publish_base=False)
    return (f"run.json of {cfg.run} in {cfg.store}; trainer key {start.fingerprint} (the join card's)"
            + (f"; {start.reclaimed}" if start.reclaimed else ""))


def _learner_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    from trainer.config import REPO_ROOT

    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), out.get("PYTHONPATH", "")) if p)
    out.setdefault("DRL_RAY_DASHBOARD", "1")
    out["PYTHONUNBUFFERED"] = "1"
    return out


def step_launch_learner(cfg: RecipeConfig, paths: BoxPaths, python: str = sys.executable,
                        env: Mapping[str, str] | None = None) -> str:
    from .boxops import alive_pid

    if alive_pid(paths.pid_file) is None:
        _mark_pointer(cfg, paths)
    return start_once("learner", learner_command(cfg, paths, python), cfg, paths, env=_learner_env(env),
                      cwd=paths.remote_dir)


def _pointer(cfg: RecipeConfig, paths: BoxPaths) -> int:
    from worker_contract.manifest import load_manifest
    from worker_contract.pointer import read_pointer

    from .anchor import open_run_store

    store = open_run_store(cfg, paths)
    pointer, _ = read_pointer(store, cfg.run, load_manifest(store, cfg.run).trainer_public_key)
    return pointer.version if pointer else 0


def _mark_file(paths: BoxPaths) -> Path:
    return Path(paths.state_dir) / "pointer.before-launch"


def _mark_pointer(cfg: RecipeConfig, paths: BoxPaths) -> None:
    """The pointer when this learner was started: `wait_learner` waits for the anchor above it."""
    mark = _mark_file(paths)
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text(f"{_pointer(cfg, paths)}\n")


def join_hint(cfg: RecipeConfig) -> str:
    """What the operator does next: print the join card (a search task's with the shared retriever's URL)."""
    from worker_contract.tasks import get_task

    url = " --retriever-url http://<retriever-host>:8000" if "retriever" in get_task(cfg.task).services else ""
    return f"hand out the join card (invoke joincard --run {cfg.run}{url})"


def step_wait_learner(cfg: RecipeConfig, paths: BoxPaths, *, timeout_s: float = WAIT_LEARNER_S,
                      poll_s: float = 2.0, log: Callable[[str], None] | None = None) -> str:
    from .boxops import alive_pid, tail

    try:
        before = int(_mark_file(paths).read_text().strip() or 0)
    except (OSError, ValueError):
        before = 0
    deadline, said = time.monotonic() + timeout_s, 0.0
    while True:
        now = _pointer(cfg, paths)
        if now > before:
            return f"the learner published v{now} (its anchor) and waits for rollouts: {join_hint(cfg)}"
        if alive_pid(paths.pid_file) is None:
            raise StepFailed("wait_learner: the learner exited before publishing its anchor; its log "
                             f"{paths.log_file} ends:\n" + "\n".join(tail(paths.log_file, 25)))
        if time.monotonic() > deadline:
            raise StepFailed(f"wait_learner: no anchor from the learner within {timeout_s:.0f} s (it is still "
                             f"running, pid file {paths.pid_file}); follow it with invoke logs --run {cfg.run}")
        if log is not None and time.monotonic() - said > 30:
            said = time.monotonic()
            log(f"  waiting for the learner's anchor (pointer v{now}); log {paths.log_file}")
        time.sleep(poll_s)


#: the native engine's on-box launch, in order (the dry run prints `info`, the launch runs `run`)
NATIVE_BOX_STEPS = [
    Step(LaunchStep(name="check_box", where="box", gpu_only=True,
                    summary="GPU and driver, disk, torch/transformers/huggingface_hub/safetensors import"),
         lambda b: step_check_box(b.cfg, b.paths)),
    Step(LaunchStep(name="install_packages", where="box",
                    summary="pip-install megatron-core and ray into this Python, only if they do not import"),
         lambda b: step_install_packages()),
    WRITE_RECIPE,
    DOWNLOAD_MODEL,
    Step(LaunchStep(name="publish_run", where="box",
                    summary="run.json (create or identical resume) and trainer.key (0600); the learner publishes v1"),
         lambda b: step_publish_run(b.cfg, b.paths)),
    Step(LaunchStep(name="launch_learner", where="box", gpu_only=True,
                    summary="setsid python -m entrypoints.learner (Ray on 127.0.0.1, dashboard 127.0.0.1:8265), log "
                            "to logs/<run>.log, pid file (skipped if alive)"),
         lambda b: step_launch_learner(b.cfg, b.paths)),
    Step(LaunchStep(name="wait_learner", where="box", gpu_only=True,
                    summary="until the learner's anchor is the pointer; then it waits for rollouts"),
         lambda b: step_wait_learner(b.cfg, b.paths, log=b.out)),
]
