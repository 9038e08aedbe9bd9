"""Invoke tasks for the trainer box of a run: `logs`, `stop`, `teardown` (the read-only view is `status
--host`). With --host they act over SSH on that box; without it, on this box (the tree it runs from).

    invoke logs --run my-run --host root@box [--follow]
    invoke stop --run my-run --host root@box [--dry-run]
    invoke teardown --run my-run --host root@box [--purge] [--dry-run]
"""

from __future__ import annotations

import json

from invoke import Exit, task

from trainer.config import REPO_ROOT

_COMMON = {
    "run": "run id (DRL_RUN)",
    "host": "the trainer box, user@host[:port] (default: this machine)",
    "ssh_key": "private key for SSH (default: your agent and ~/.ssh keys)",
    "remote_dir": "the tree on the box (default /root/dRL over SSH, this checkout locally)",
}


def _args(run: str | None, host: str | None, remote_dir: str | None) -> tuple[str, str]:
    from worker_contract.layout import check_run_id

    if not run:
        raise Exit("--run is required: the run id (DRL_RUN) the trainer was launched with", code=2)
    try:
        check_run_id(run)
    except ValueError as e:
        raise Exit(str(e), code=2) from None
    if host:
        from infra.remote import parse_host

        try:
            parse_host(host)
        except ValueError as e:
            raise Exit(str(e), code=2) from None
    return run, remote_dir or ("/root/dRL" if host else str(REPO_ROOT))


@task(positional=[], auto_shortflags=False, help={**_COMMON, "lines": "how many last lines (default 100)",
                                                  "follow": "keep printing new lines until Ctrl-C"})
def logs(c, run=None, host=None, ssh_key=None, remote_dir=None, lines=100, follow=False):
    """Print the trainer's log (<remote_dir>/logs/<run>.log) from the box."""
    from infra.remote import logs as remote_logs

    run, rd = _args(run, host, remote_dir)
    code = remote_logs(host, run, ssh_key=ssh_key, remote_dir=rd, lines=int(lines), follow=follow)
    if code:
        raise Exit(code=code)


@task(positional=[], auto_shortflags=False, help={**_COMMON, "dry_run": "say what would be stopped; stop nothing"})
def stop(c, run=None, host=None, ssh_key=None, remote_dir=None, dry_run=False):
    """Stop the run's trainer on the box: its Ray jobs and its process group, by PID."""
    from infra.remote import stop as remote_stop

    run, rd = _args(run, host, remote_dir)
    print(json.dumps(remote_stop(host, run, ssh_key=ssh_key, remote_dir=rd, dry_run=dry_run), indent=2))


@task(positional=[], auto_shortflags=False, help={
    **_COMMON, "purge": "also delete the remote dir (tree, models, checkpoints, logs)",
    "dry_run": "list what would be stopped and deleted; change nothing"})
def teardown(c, run=None, host=None, ssh_key=None, remote_dir=None, purge=False, dry_run=False):
    """Stop the run and the Ray it started, delete the box's credentials (and with --purge, everything)."""
    from infra.remote import teardown as remote_teardown

    run, rd = _args(run, host, remote_dir)
    out = remote_teardown(host, run, ssh_key=ssh_key, remote_dir=rd, purge=purge, dry_run=dry_run)
    print(json.dumps(out, indent=2))
    if not dry_run and host:
        print(f"Credentials are off the box. Stop billing for {host} at your GPU provider if you rented it.")
