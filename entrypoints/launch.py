"""`python -m entrypoints.launch --recipe gsm8k --run RUN [--host H] [--model PATH] [--ssh-key K] [--remote-dir D]`

What `make gsm8k RUN=<id>` runs. It resolves the recipe (embedded.config.resolve_embedded: trainer.config.resolve
with the `embedded:` section typed), then picks where the job runs, in this order:
    --host given                                   -> infra.remote.launch_remote (the GPU box over SSH)
    a CUDA GPU here and R2 credentials or DRL_STORE -> infra.launch_gpu.launch_on_this_box
    otherwise                                      -> the embedded default (embedded.run)
DRL_DRY_RUN=1 prints the fully resolved configuration and exactly what would run (secrets redacted) and
changes nothing. An unknown recipe or a bad run id is refused with exit status 2.
"""


from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from typing import Literal

Mode = Literal["remote", "gpu", "embedded"]

EPILOG = """how the mode is chosen, in this order:
  --host given (HOST=)                              the real trainer on that GPU box over SSH
  a CUDA GPU here and R2 credentials or DRL_STORE   the real trainer on this machine
  otherwise                                         the embedded default: the whole loop here, on the CPU

environment it reads (checked once, strictly; a bad value is refused by name):
  DRL_RUN           the run id when --run is not given
  DRL_DRY_RUN       1 prints the resolved configuration and what would run, and changes nothing (0/1,
                    true/false, yes/no, on/off; anything else is refused)
  DRL_STORE         file:///abs/path, r2://<bucket> or s3://<bucket> (default: R2 when its four values are
                    set, else the local file store .stoa/bucket)
  DRL_N_SAMPLES     group size (an integer >= 1); DRL_PULSE_PLANE bf16 | int8g64; DRL_KV_MODE
  R2_ACCOUNT_ID, R2_ACCESS_KEY_ID, R2_SECRET_ACCESS_KEY, R2_BUCKET
                    the bucket; read from .r2env (mode 0600) too, the environment winning; all four or none
  DRL_S3_ENDPOINT   the S3 endpoint of an s3:// store
  DRL_NO_GPU        1 ignores a CUDA GPU here (the embedded default)
exit status: 0 done, 2 bad input (one sentence says what to fix), 1 a launch step failed"""


#: recipe key -> what the user typed to set it (make variable / launcher flag), for error messages
FLAG_NAMES = {"run": "RUN (--run)", "model.path": "MODEL (--model)", "launch.remote_dir": "REMOTE_DIR (--remote-dir)",
              "train.engine": "ENGINE (--engine)", "embedded.worker_backend": "WORKER (--worker)"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m entrypoints.launch", description=__doc__.split("\n\n")[0],
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True, help="recipe name (runs/): gsm8k, psqa; or the path of a recipe "
                    "YAML file, validated the same way")
    ap.add_argument("--run", default=None, help="run id, the bucket prefix (default: DRL_RUN)")
    ap.add_argument("--host", default=None, help="user@gpu-box: launch the real trainer there over SSH")
    ap.add_argument("--model", default=None, help="a local HF model directory to train instead of the default")
    ap.add_argument("--ssh-key", default=None, help="SSH private key for --host")
    ap.add_argument("--remote-dir", default=None, help="where the tree goes on --host (default /root/dRL)")
    ap.add_argument("--engine", default=None, help="learner on a GPU box: native (our megatron-core learner) or "
                    "slime (slime's train.py, the slime image); default: the recipe's train.engine (ENGINE=)")
    ap.add_argument("--worker", default=None, help="embedded run: the local workers' backend, torch (default) or "
                    "mlx (the MLX worker, as on a Mac) (WORKER=)")
    return ap.parse_args(argv)


#: what a machine with an NVIDIA (or ROCm) driver has; torch.cuda sees no GPU without one of them
_GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")


def has_cuda() -> bool:
    """A CUDA GPU torch can use (DRL_NO_GPU=1 pretends there is none)."""
    from worker_contract.env import env_bool

    if env_bool("DRL_NO_GPU", os.environ.get("DRL_NO_GPU", "")):
        return False
    if not any(os.path.exists(p) for p in _GPU_DRIVER_PATHS):
        return False  # no GPU driver on this machine: spares importing torch (about 3 s of CPU)
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def choose_mode(*, host: str | None, env: Mapping[str, str], gpu: bool) -> tuple[Mode, str]:
    """Where the job runs and why (a pure function of its inputs, so the decision is testable)."""
    if host:
        return "remote", f"HOST={host}: the real trainer on that GPU box over SSH"
    has_r2 = all(env.get(v, "").strip() for v in ("R2_ACCOUNT_ID", "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY",
                                                   "R2_BUCKET"))
    has_store = bool(env.get("DRL_STORE", "").strip())
    if gpu and (has_r2 or has_store):
        return "gpu", "a CUDA GPU and " + ("R2 credentials" if has_r2 else "DRL_STORE") + ": the real trainer here"
    why = "no HOST, " + ("a CUDA GPU but no R2 credentials or DRL_STORE" if gpu else "no CUDA GPU")
    return "embedded", f"{why}: the embedded default on this machine"


def _dump(cfg) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=None, width=110)


def dry_run(cfg, mode: Mode, why: str, env: Mapping[str, str], out: Callable[[str], None]) -> None:
    """The resolved config, the contract environment (secrets redacted) and what would run."""
    from worker_contract.env import R2_VARS, REDACTED, SECRET_VARS

    if mode == "embedded":
        from embedded.run import STOA_DIR, EmbeddedPaths, embedded_cfg

        paths = EmbeddedPaths(STOA_DIR, cfg.run)
        cfg = embedded_cfg(cfg, paths)
    out(f"# DRL_DRY_RUN=1: nothing is changed\n# mode: {mode} ({why})\n# resolved configuration:")
    out(_dump(cfg))
    out("# environment:")
    shown = [(v, env[v]) for v in ("DRL_RUN", "DRL_STORE", "DRL_N_SAMPLES", "DRL_PULSE_PLANE", "DRL_KV_MODE", *R2_VARS)
             if env.get(v, "")]
    for var, value in shown:
        out(f"{var}={REDACTED if var in SECRET_VARS else value}")
    if not shown:
        out("(no DRL_* contract or R2_* variables set)")
    if mode == "embedded":
        from embedded.run import plan_lines

        out("# will run:")
        for line in plan_lines(cfg, paths):
            out(line)


def launch(argv: list[str] | None = None, env: Mapping[str, str] | None = None,
           out: Callable[[str], None] = print) -> int:
    """Parse, check the inputs, choose the mode, resolve the recipe for it, then run (or dry-run) there."""
    args = parse_args(argv)
    from worker_contract.env import EnvError

    for name in ("run", "host", "model", "ssh_key", "remote_dir"):  # make passes an unset variable as ""
        setattr(args, name, getattr(args, name) or None)
    try:
        recipe_tree, env, dry = _read_inputs(args, env)
    except (ValueError, EnvError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mode, why = choose_mode(host=args.host, env=env, gpu=has_cuda())
    try:
        cfg = _resolve(args, recipe_tree, env, mode)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _run(cfg, args, mode, why, env, dry, out)


def _read_inputs(args: argparse.Namespace, env: Mapping[str, str] | None) -> tuple[dict, Mapping[str, str], bool]:
    """The recipe file, the environment (with .r2env) and whether it asks for a dry run, with the run id
    set on `args`: all checked before a mode is chosen."""
    from trainer.config import REPO_ROOT, load_recipe_file, recipe_path
    from worker_contract import layout
    from worker_contract.env import default_store_url, load_env, parse_env

    recipe_tree = load_recipe_file(recipe_path(args.recipe))
    env = load_env(env, repo_root=REPO_ROOT)
    contract = parse_env(env)  # the one validation of the contract variables, DRL_DRY_RUN included
    args.run = args.run or contract.require_run()
    layout.check_run_id(args.run)
    if args.host:
        from infra.remote import parse_host

        parse_host(args.host)
    default_store_url(env, REPO_ROOT)  # DRL_STORE understood; R2 all four values or none
    return recipe_tree, env, contract.dry_run


def _overrides(args: argparse.Namespace) -> dict:
    """The recipe keys the flags set."""
    overrides = {"run": args.run, "model.path": os.path.abspath(args.model) if args.model else None}
    if args.remote_dir:
        overrides["launch.remote_dir"] = args.remote_dir
    if args.worker:  # make passes an unset WORKER as ""; a bad name is refused by the recipe's schema
        overrides["embedded.worker_backend"] = args.worker
        overrides["embedded.worker_backends"] = []  # every local worker on that backend (psqa mixes torch and mlx)
    if args.engine:  # make passes an unset ENGINE as ""; a bad name is refused by the recipe's schema
        overrides["train.engine"] = args.engine
    return overrides


def _resolve(args: argparse.Namespace, recipe_tree: dict, env: Mapping[str, str], mode: Mode):
    """The recipe resolved for `mode` with the flags' overrides; a ValueError where the recipe, the engine or
    MODEL cannot run there."""
    from embedded.config import resolve_embedded

    overrides = _overrides(args)
    if mode == "embedded" and "embedded" not in recipe_tree:  # no embedded: section, no run on this machine
        raise ValueError(f"the {recipe_tree.get('name', args.recipe)} recipe has no embedded run: give "
                         "HOST=user@box (a GPU box), or "
                         "run it on a GPU box with R2 credentials")
    if mode == "embedded" and args.engine == "slime":
        raise ValueError("ENGINE=slime runs slime's train.py on a GPU box with the slime image: give "
                         "HOST=user@box, or leave ENGINE unset for the embedded run here")
    if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise ValueError(f"MODEL={args.model!r} is not an HF model directory (no config.json there)")
    if args.model:  # the dry run refuses the config.json the run would refuse
        from trainer.models.hf_io import load_hf_config

        load_hf_config(args.model)
    return resolve_embedded(args.recipe, env, overrides, local=mode == "embedded", override_names=FLAG_NAMES)


def _run(cfg, args: argparse.Namespace, mode: Mode, why: str, env: Mapping[str, str], dry: bool,
         out: Callable[[str], None]) -> int:
    """Hand the resolved recipe to the mode's launcher (after the dry run's listing, when asked)."""
    if dry:
        dry_run(cfg, mode, why, env, out)
    if mode == "remote":
        from infra.remote import launch_remote

        return launch_remote(cfg, host=args.host, ssh_key=args.ssh_key, remote_dir=args.remote_dir, dry_run=dry,
                             out=out)
    if mode == "gpu":
        from infra.launch_gpu import launch_on_this_box

        return launch_on_this_box(cfg, dry_run=dry, out=out)
    if dry:
        return 0
    from embedded.run import run_embedded

    return run_embedded(cfg)


def main(argv: list[str] | None = None) -> int:
    from worker_contract.cli import run_main

    return run_main(lambda: launch(argv), "python -m entrypoints.launch")


if __name__ == "__main__":
    sys.exit(main())
