"""Operator tasks: `status`, `plot`, `gc`, `preflight`. Each parses its flags and calls one function.

`status` is read-only; `gc` changes the bucket, so it has `--dry-run`.
"""

from __future__ import annotations

from pathlib import Path

from invoke import Exit

from .taskkit import REPO_ROOT, confirm, int_flag, need_run, stoa_task


def _need_run(run: str | None) -> str:
    return need_run(run, "the run id (DRL_RUN) to look at")


def open_existing_store(store: str | None, run: str, repo_root: Path = REPO_ROOT):
    """The store named by --store, else DRL_STORE / R2 credentials (.r2env) / the embedded file store,
    opened for reading: a file store that does not exist is refused, never created."""
    from urllib.parse import urlparse

    from worker_contract.env import load_env, parse_env, store_url
    from worker_contract.store import open_store

    env = load_env(repo_root=repo_root)
    parse_env(env)  # the one check of the contract variables: a malformed DRL_* is refused here too
    url = store_url(store, env, repo_root)
    if url.startswith("file://") and not Path(urlparse(url).path).is_dir():
        raise ValueError(f"run {run!r} is not here: there is no store at {url} (nothing has been published "
                         "there; the embedded run makes it); pass --store or set DRL_STORE to the run's bucket")
    return open_store(url, env)


def _published(st, run: str) -> None:
    """Refuse a run the store does not hold (status and gc say so instead of showing an empty run)."""
    from infra.ops.status import read_manifest

    if read_manifest(st, run) is None:
        raise ValueError(f"run {run!r} has no run.json in {st.url}: check the run id (DRL_RUN) and the store "
                         "(--store or DRL_STORE)")


@stoa_task(help={
    "run": "run id (default: DRL_RUN)",
    "store": "store URL (default: DRL_STORE, else r2:// from the credentials, else the embedded file store)",
    "watch": "refresh every few seconds until Ctrl-C",
    "json": "print JSON for scripts instead of tables",
    "host": "also show the trainer box's own state (user@host)",
    "ssh_key": "SSH private key for --host",
    "remote_dir": "the tree's directory on the box (default /root/dRL)",
})
def status(c, run=None, store=None, watch=False, json_=False, host=None, ssh_key=None, remote_dir=None):
    """Read-only view of a run from the bucket: pointer, anchors, workers, staleness, drops, bytes, cost."""
    run = _need_run(run)
    if host:
        from infra.remote import parse_host

        parse_host(host)
    st = open_existing_store(store, run)
    _published(st, run)
    from infra.ops.status_view import show_status  # Rich and the tables: only once the input is known good

    show_status(st, run, watch=watch, as_json=json_, host=host, ssh_key=ssh_key, remote_dir=remote_dir)


@stoa_task(help={
    "run": "run id whose .stoa/runs/<run>/metrics.jsonl to plot",
    "out": "output folder (default .stoa/runs/<run>/plots)",
})
def plot(c, run=None, out=None):
    """PNG plots of reward, held-out accuracy, staleness, gate drops and patch size by step."""
    from infra.ops.plots import plot_run
    from worker_contract.cli import output_dir

    run_dir = REPO_ROOT / ".stoa" / "runs" / _need_run(run)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise Exit(f"{metrics} does not exist: run `make gsm8k RUN={run}` first, or check the run id", code=2)
    try:
        where = output_dir(out if out else run_dir / "plots")
    except ValueError as e:
        raise Exit(str(e), code=2) from None
    paths = plot_run(metrics, where)
    if not paths:  # empty, or lines that are not the learner's step rows: say so instead of printing nothing
        raise Exit(f"{metrics} holds no step row with a metric to plot (reward, held-out accuracy, staleness, "
                   "drops, patch size): nothing written", code=2)
    for path in paths:
        print(path)


@stoa_task(help={
    "run": "run id (default: DRL_RUN)",
    "keep_anchors": "anchors at or below the pointer to keep (default 2, at least 1)",
    "dry_run": "print what would be deleted and delete nothing",
    "yes": "delete without asking (scripts); on a terminal gc asks first",
    "store": "store URL (default as for status)",
})
def gc(c, run=None, keep_anchors=None, dry_run=False, yes=False, store=None):
    """Delete old anchors, patches and rollouts of one run that no joiner can need any more (asks first)."""
    from infra.ops.gc import apply_gc, plan_gc
    from trainer.progress import progress

    run = _need_run(run)
    keep = int_flag("--keep-anchors", keep_anchors, 2, minimum=1)
    st = open_existing_store(store, run)
    plan = plan_gc(st, run, keep)
    print(("[dry run] " if dry_run else "") + plan.summary())
    if dry_run:
        for key in plan.keys:
            print(f"  would delete {key}")
        return
    if not plan.keys:
        print("nothing to delete")
        return
    confirm([f"delete {len(plan.keys)} objects under {st.url}/{run}/ (listed by --dry-run)"], yes=yes)
    with progress("deleting", total=len(plan.keys)) as advance:
        n = apply_gc(st, plan, advance)
    print(f"deleted {n} objects")


@stoa_task(help={
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
