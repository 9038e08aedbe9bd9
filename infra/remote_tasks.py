"""Invoke tasks for the trainer box of a run: `logs`, `stop`, `teardown` (the read-only view is `status
--host`). With --host they act over SSH on that box; on this machine only when --local says so (a
forgotten --host never turns the checkout you type in into "the box").

    invoke logs     --run my-run --host root@box [--follow]
    invoke stop     --run my-run --host root@box [--dry-run] [--yes]
    invoke teardown --run my-run --host root@box [--purge] [--dry-run] [--yes]
More in docs/quickstart-gpu.md (module notes).
"""

from __future__ import annotations

import json

from invoke import Exit

from .taskkit import REPO_ROOT, UsageError, confirm, int_flag, need_run, stoa_task

_COMMON = {
    "run": "run id (default: DRL_RUN)",
    "host": "the trainer box, user@host[:port]; required unless --local",
    "local": "act on this machine (the run's files under --remote-dir, default this checkout) instead of a box",
    "ssh_key": "private key for SSH (default: your agent and ~/.ssh keys)",
    "remote_dir": "the tree on the box (default /root/dRL over SSH, this checkout with --local)",
}


def _args(run: str | None, host: str | None, local: bool, remote_dir: str | None) -> tuple[str, str | None, str]:
    """(run, host or None for this machine, the tree's directory), or a UsageError naming the fix."""
    run = need_run(run, "the run id (DRL_RUN) the trainer was launched with")
    if host and local:
        raise UsageError("give --host or --local, not both")
    if not host and not local:
        raise UsageError("no --host given: name the trainer box with --host user@box, or pass --local to act "
                         "on this machine")
    if host:
        from infra.remote import parse_host

        parse_host(host)
    return run, host or None, remote_dir or ("/root/dRL" if host else str(REPO_ROOT))


@stoa_task(help={**_COMMON, "lines": "how many last lines (default 100)",
                 "follow": "keep printing new lines until Ctrl-C"})
def logs(c, run=None, host=None, local=False, ssh_key=None, remote_dir=None, lines=None, follow=False):
    """Print the trainer's log (<remote_dir>/logs/<run>.log) from the box."""
    from infra.remote import logs as remote_logs

    run, host, rd = _args(run, host, local, remote_dir)
    code = remote_logs(host, run, ssh_key=ssh_key, remote_dir=rd, lines=int_flag("--lines", lines, 100, 1),
                       follow=follow)
    if code:
        raise Exit(code=code)


def _plan(host, run, rd, ssh_key, step: str, purge: bool = False) -> list[str]:
    """What `step` would do, from the box itself (its dry run): the lines it logs, one per action."""
    import contextlib
    import io

    from infra.remote import stop as remote_stop
    from infra.remote import teardown as remote_teardown

    with contextlib.redirect_stderr(io.StringIO()):  # the box's own "would ..." lines: the list below says it
        if step == "stop":
            from .boxops import leftovers_action

            out = remote_stop(host, run, ssh_key=ssh_key, remote_dir=rd, dry_run=True)
            if out.get("launcher"):
                return [f"stop the launcher of run {run} (pid {out['launcher']}, e.g. make gsm8k|psqa RUN={run}) as "
                        "Ctrl-C would (SIGTERM): it stops its learner, which checkpoints, and its workers"]
            left = out.get("leftovers", [])
            if out.get("ray_jobs_listed", True) and not (out["ray_jobs"] or out["pid"] or left):
                return []  # nothing to stop (Ray's jobs unknown is not nothing)
            return [f"stop Ray jobs {', '.join(out['ray_jobs']) or 'none'} and the trainer process group "
                    f"{out['pid'] or '(none running)'} of run {run}"] + ([leftovers_action(run, left)] if left else [])
        return remote_teardown(host, run, ssh_key=ssh_key, remote_dir=rd, purge=purge, dry_run=True)["actions"]


@stoa_task(help={**_COMMON, "dry_run": "say what would be stopped; stop nothing",
                 "yes": "stop without asking (scripts)"})
def stop(c, run=None, host=None, local=False, ssh_key=None, remote_dir=None, dry_run=False, yes=False):
    """Stop the run's trainer: its Ray jobs and its process group, by PID; a `make gsm8k` or `make psqa` of the
    run here is stopped as Ctrl-C would stop it in its terminal (asks first)."""
    from infra.remote import stop as remote_stop

    run, host, rd = _args(run, host, local, remote_dir)
    where = host or "this machine"
    if dry_run:
        print(json.dumps(remote_stop(host, run, ssh_key=ssh_key, remote_dir=rd, dry_run=True), indent=2))
        return
    plan = _plan(host, run, rd, ssh_key, "stop")
    if not plan:
        print(f"nothing of run {run} is running on {where} ({rd}): nothing to stop")
        return
    print(f"on {where} ({rd}):")
    confirm(plan, yes=yes)
    print(json.dumps(remote_stop(host, run, ssh_key=ssh_key, remote_dir=rd), indent=2))


@stoa_task(help={
    **_COMMON, "purge": "also delete the run's own directories on the box (.stoa/runs/<run>/, logs/<run>.log)",
    "dry_run": "list what would be stopped and deleted; change nothing",
    "yes": "go ahead without asking (scripts)"})
def teardown(c, run=None, host=None, local=False, ssh_key=None, remote_dir=None, purge=False, dry_run=False,
             yes=False):
    """Stop the run and the Ray it started, delete the box's credentials (with --purge, the run's files)."""
    from infra.remote import teardown as remote_teardown

    run, host, rd = _args(run, host, local, remote_dir)
    where = host or "this machine"
    actions = _plan(host, run, rd, ssh_key, "teardown", purge)
    if dry_run:
        print(json.dumps({"run": run, "on": where, "actions": actions, "dry_run": True}, indent=2))
        return
    print(f"on {where} ({rd}):")
    confirm(actions, yes=yes)
    out = remote_teardown(host, run, ssh_key=ssh_key, remote_dir=rd, purge=purge)
    print(json.dumps(out, indent=2))
    if host:
        print(f"Credentials are off the box. Stop billing for {host} at your GPU provider if you rented it.")
