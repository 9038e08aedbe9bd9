"""Operator tasks: `status`, `plot`, `gc`, `preflight`. Each parses its flags and calls one function.

`status` is read-only; `gc` changes the bucket, so it has `--dry-run`.
"""

from __future__ import annotations

from pathlib import Path

from invoke import Exit, task

REPO_ROOT = Path(__file__).resolve().parent.parent


def _need_run(run: str | None) -> str:
    from worker_contract.layout import check_run_id

    if not run:
        raise Exit("--run is required: the run id (DRL_RUN) to look at", code=2)
    try:
        return check_run_id(run)
    except ValueError as e:
        raise Exit(str(e), code=2) from None


def _open_store(store: str | None):
    """The store named by --store, else DRL_STORE / R2 credentials (.r2env) / the embedded file store."""
    from worker_contract.env import default_store_url, load_env
    from worker_contract.store import open_store

    env = load_env(repo_root=REPO_ROOT)
    return open_store(store or default_store_url(env, REPO_ROOT), env)


@task(positional=[], auto_shortflags=False, help={
    "run": "run id (DRL_RUN)",
    "store": "store URL (default: DRL_STORE, else r2:// from the credentials, else the embedded file store)",
    "watch": "refresh every few seconds until Ctrl-C",
    "json": "print JSON for scripts instead of tables",
    "host": "also show the trainer box's own state (user@host)",
    "ssh_key": "SSH private key for --host",
    "remote_dir": "the tree's directory on the box (default /root/dRL)",
})
def status(c, run=None, store=None, watch=False, json_=False, host=None, ssh_key=None, remote_dir=None):
    """Read-only view of a run from the bucket: pointer, anchors, workers, staleness, drops, bytes, cost."""
    from infra.ops.status_view import show_status

    show_status(_open_store(store), _need_run(run), watch=watch, as_json=json_, host=host, ssh_key=ssh_key,
                remote_dir=remote_dir)


@task(positional=[], auto_shortflags=False, help={
    "run": "run id whose .stoa/runs/<run>/metrics.jsonl to plot",
    "out": "output folder (default .stoa/runs/<run>/plots)",
})
def plot(c, run=None, out=None):
    """PNG plots of reward, held-out accuracy, staleness, gate drops and patch size by step."""
    from trainer.plots import plot_run

    run_dir = REPO_ROOT / ".stoa" / "runs" / _need_run(run)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise Exit(f"{metrics} does not exist: run `make gsm8k RUN={run}` first, or check the run id", code=2)
    for path in plot_run(metrics, Path(out) if out else run_dir / "plots"):
        print(path)


@task(positional=[], auto_shortflags=False, help={
    "run": "run id (DRL_RUN)",
    "keep_anchors": "anchors at or below the pointer to keep (at least 1)",
    "dry_run": "print what would be deleted and delete nothing",
    "store": "store URL (default as for status)",
})
def gc(c, run=None, keep_anchors=2, dry_run=False, store=None):
    """Delete old anchors, patches and rollouts that no joiner can need any more."""
    from infra.ops.gc import GcError, apply_gc, plan_gc
    from trainer.progress import progress

    st = _open_store(store)
    try:
        plan = plan_gc(st, _need_run(run), int(keep_anchors))
    except GcError as e:
        raise Exit(str(e), code=2) from None
    print(("[dry run] " if dry_run else "") + plan.summary())
    if dry_run:
        for key in plan.keys:
            print(f"  would delete {key}")
        return
    with progress("deleting", total=len(plan.keys)) as advance:
        n = apply_gc(st, plan, advance)
    print(f"deleted {n} objects")


@task(positional=[], auto_shortflags=False, help={
    "recipe": "resolve this recipe here (gsm8k | psqa) instead of reading a dry run on stdin",
    "run": "run id with --recipe (default DRL_RUN)",
    "profile": "quickstart | fleet (default DRL_PREFLIGHT_PROFILE, else by recipe)",
    "host": "GPU box user@host for the box checks (default: the plan's host)",
    "ssh_key": "SSH private key for the box",
    "hf_dir": "local HF checkpoint dir for the model-identity checks",
    "env_file": "credentials file (default .r2env, mode 0600)",
    "store": "store URL (default: the plan's, else DRL_STORE / R2 / file store)",
    "json": "print the rows as JSON",
})
def preflight(c, recipe=None, run=None, profile=None, host=None, ssh_key=None, hf_dir=None, env_file=None,
              store=None, json_=False):
    """Check a launch before it happens (reads a dry run on stdin, or resolves --recipe); exit 1 on any FAIL."""
    from infra.preflight import main

    flags = {"--recipe": recipe, "--run": run, "--profile": profile, "--host": host, "--ssh-key": ssh_key,
             "--hf-dir": hf_dir, "--env-file": env_file, "--store": store}
    argv = [x for k, v in flags.items() if v for x in (k, v)] + (["--json"] if json_ else [])
    code = main(argv)
    if code:
        raise Exit(code=code)
