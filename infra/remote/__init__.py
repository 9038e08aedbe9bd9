"""`make gsm8k RUN=<id> HOST=user@box`: stand the real trainer up on a GPU box over Fabric SSH.

| module    | holds                                                                             |
|-----------|-----------------------------------------------------------------------------------|
| ssh.py    | HOST parsing, Fabric connection, one step = one command, RemoteStepError (stderr) |
| deploy.py | check_box, ship_tree (tar over SFTP), ship_credentials (0600), install_deps       |
| ops.py    | remote_status, logs, stop, teardown (`python3 -m infra.boxops` on the box)        |

The launch ships the tree and the credentials, then runs `python3 -m infra.launch_gpu` on the box: the same
`launch_on_this_box` that `make gsm8k` runs on a GPU box itself. One code path, reached two ways.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from trainer.config import REPO_ROOT, RecipeConfig

from .ops import logs, remote_status, stop, teardown
from .ssh import HostSpec, RemoteStepError, connect, parse_host

#: credential and endpoint variables shipped to the box's .r2env (when set locally)
SHIPPED_VARS = ("R2_ACCOUNT_ID", "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY", "R2_BUCKET", "DRL_S3_ENDPOINT",
                "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION")


def launch_remote(cfg: RecipeConfig, *, host: str, ssh_key: str | None = None, remote_dir: str | None = None,
                  dry_run: bool = False, out: Callable[[str], None] = print, python: str = "python3",
                  repo_root: str | Path = REPO_ROOT) -> int:
    """Check the box, ship tree and credentials, run the on-box launch; 0 on success, 1 on a failed step."""
    from worker_contract.env import load_env

    from ..launch_gpu import build_plan, resolve_store
    from ..launch_plan import render_plan
    from ..slime_launch import BoxPaths
    from ..steps import bound, run_steps
    from . import deploy

    parse_host(host)
    remote_dir = remote_dir or cfg.launch.remote_dir
    env = load_env(repo_root=repo_root)
    store = resolve_store(cfg, env)
    plan = build_plan(cfg, host=host, remote_dir=remote_dir, env=env, store=store)
    if dry_run:
        out(render_plan(plan))
    if store.startswith("file://"):  # the dry run says it too: it shows what the launch would do, refusals included
        # on stderr: a dry run's stdout is the plan, piped to the preflight (`| nox -s preflight`)
        print("a GPU box publishes to the shared bucket: put R2_ACCOUNT_ID, R2_ACCESS_KEY_ID, R2_SECRET_ACCESS_KEY "
              "and R2_BUCKET in .r2env (mode 0600; docs/r2-setup.md) or set DRL_STORE=r2://<bucket>", file=sys.stderr)
        return 2
    if dry_run:
        return 0
    creds = {k: env[k] for k in SHIPPED_VARS if env.get(k)}
    cfg = cfg.model_copy(update={"store": store, "launch": cfg.launch.model_copy(update={"remote_dir": remote_dir})})
    paths = BoxPaths(remote_dir=remote_dir, run=plan.run, model_dir_override=cfg.model.path)
    try:
        import paramiko

        ssh_errors: tuple[type[BaseException], ...] = (paramiko.SSHException,)
    except ImportError:  # fabric always brings paramiko; keep the launcher importable without it
        ssh_errors = ()
    conn = connect(host, ssh_key)
    try:
        ctx = deploy.RemoteLaunch(conn=conn, host=host, cfg=cfg, recipe_file=paths.recipe_file, repo_root=repo_root,
                                  python=python, creds=creds)
        return run_steps(bound(deploy.remote_steps(cfg.train.engine), ctx), out, catch=ssh_errors)
    finally:
        conn.close()


__all__ = ["HostSpec", "RemoteStepError", "connect", "launch_remote", "logs", "parse_host", "remote_status",
           "stop", "teardown"]
