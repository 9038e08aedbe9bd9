"""The on-box launch steps both engines share, and what every on-box step is given (`BoxLaunch`).

Each engine's on-box launch is one list of `Step`s (infra/steps.py): infra/launch_gpu.py's for slime,
infra/native_launch.py's for the native engine. The dry run prints their `info`; the launch runs them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import RecipeConfig

from .launch_plan import LaunchStep
from .slime_launch import BoxPaths
from .steps import Step, StepFailed


@dataclass(frozen=True)
class BoxLaunch:
    """What an on-box step is given: the resolved recipe (its store set), the box's paths, the environment
    the launch read, and where progress lines go."""

    cfg: RecipeConfig
    paths: BoxPaths
    env: Mapping[str, str]
    out: Callable[[str], None] = print


def check_this_box(cfg: RecipeConfig, paths: BoxPaths, engine: str) -> dict[str, Any]:
    """infra/box_check.py's report on this machine, holding its disk to the recipe's figure (the models' and this
    run's files count toward it; DRL_MIN_FREE_GB overrides it)."""
    from . import box_check
    from .slime_launch import disk_floor_gb, hf_config_for, reused_model_dirs

    return box_check.run_checks(paths.remote_dir, cfg.launch.slime_dir, cfg.launch.megatron_dir,
                                disk_floor_gb(cfg, hf_config_for(cfg, paths)[0]), engine=engine, run=cfg.run,
                                model_dirs=reused_model_dirs(cfg, paths))


def box_report(report: dict[str, Any]) -> str:
    """`check_box`'s answer from infra/box_check.py's report: StepFailed naming each failed check, else the
    GPUs and the free disk."""
    if not report["ok"]:
        raise StepFailed("check_box:\n" + "\n".join(f"  {k}: {v['error']}" for k, v in report.items()
                                                     if isinstance(v, dict) and not v["ok"]))
    gpus = ", ".join(f"{g['name']} ({g['memory_mib'] // 1024} GiB, driver {g['driver']})" for g in report["gpu"]["gpus"])
    return f"{gpus}; {report['disk']['free_gb']} GB free"


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


def start_once(what: str, argv: list[str], cfg: RecipeConfig, paths: BoxPaths, **kwargs: Any) -> str:
    """Start `argv` detached (its log and pid file under `paths`) unless the pid file names a live process."""
    from .boxops import alive_pid, start_detached

    pid = alive_pid(paths.pid_file)
    if pid is not None:
        return f"{what} already running (pid {pid}); log {paths.log_file}"
    pid = start_detached(argv, log_file=paths.log_file, pid_file=paths.pid_file, **kwargs)
    return f"pid {pid}, log {paths.log_file} (follow: invoke logs --run {cfg.run} --follow)"


WRITE_RECIPE = Step(LaunchStep(name="write_recipe", where="box",
                               summary="resolved recipe to <state>/recipe.json (the plugin or learner reads it)"),
                    lambda b: step_write_recipe(b.cfg, b.paths))
DOWNLOAD_MODEL = Step(LaunchStep(name="download_model", where="box", gpu_only=True,
                                 summary="huggingface_hub.snapshot_download into .stoa/models (skips what it has)"),
                      lambda b: step_download_model(b.cfg, b.paths))
