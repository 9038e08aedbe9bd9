"""`nox -s preflight` / `invoke preflight` / `python -m infra.preflight`: check a launch before it happens.

Reads the resolved launch (piped from a dry run, or resolved here from a recipe and the environment) and
checks it against the profile DRL_PREFLIGHT_PROFILE names (`quickstart` or `fleet`): one row per check,
exit 1 on any FAIL, and no secret ever printed.
More in docs/operations.md (module notes).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROFILE_VAR = "DRL_PREFLIGHT_PROFILE"


def _checks():
    """(check function, whether it runs under a profile, what it needs: None, "host" (a host was given) or
    "box" (a working connection to the box)) in report order. A check of a pinned value runs where the
    profile's recipe pins it (its `preflight.pinned`)."""
    from infra import preflight_checks as c
    from infra import preflight_env as e

    def always(p):
        return True

    return [
        (c.check_n_samples, lambda p: p.n_samples is not None, None),
        (c.check_plane, lambda p: p.plane is not None, None), (c.check_kv_mode, lambda p: p.kv_mode is not None, None),
        (c.check_contract_agrees, always, None),
        (c.check_save_interval, lambda p: "--save-interval" in p.fixed_flags, None),
        (c.check_dual_clip, always, None), (c.check_gate, always, None),
        (c.check_reducer, always, None), (c.check_no_save_hf, always, None),
        (c.check_algo, lambda p: bool(p.algo), None), (c.check_batch, lambda p: p.batch_groups is not None, None),
        (c.check_rotary, always, None), (c.check_vocab_tokenizer, always, None),
        (e.check_credentials, always, None), (e.check_store, always, None), (e.check_bucket, always, None),
        (e.check_run_id, always, None), (e.check_base_anchor, always, None),
        (e.check_ssh, always, "host"),
        (e.check_gpu, always, "box"), (e.check_gpu_memory, always, "box"), (e.check_disk, always, "box"),
        (e.check_ray_dashboard, always, "box"), (e.check_slime, always, "box"),
    ]


def ssh_runner(host: str, ssh_key: str | None = None) -> Callable[[str], tuple[int, str]]:
    """Run shell commands on `host` over SSH (infra.remote's Fabric connection); returns (exit code, stdout)."""
    import logging

    from infra.remote.ssh import connect

    # paramiko logs a failed handshake with a traceback from its own thread; the box.ssh row reports it
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)
    conn = connect(host, ssh_key)

    def run(cmd: str) -> tuple[int, str]:
        r = conn.run(cmd, hide=True, warn=True, pty=False, in_stream=False)
        return r.exited, r.stdout

    return run


def _local_hf_dir(plan, cfg) -> str | None:
    """An HF checkpoint on this machine: MODEL=, or where the launch downloads it (preflight on the box)."""
    from infra.slime_launch import BoxPaths

    candidates = [cfg.model.path]
    if cfg.model.hf_id:
        candidates.append(BoxPaths(remote_dir=plan.remote_dir, run=plan.run).hf_dir(cfg.model.hf_id))
    return next((c for c in candidates if c and (Path(c) / "config.json").is_file()), None)


def build_context(plan, *, profile: str, env: Mapping[str, str] | None = None, env_file: str | None = None,
                  store: str | None = None, hf_dir: str | None = None, host: str | None = None,
                  run_box: Callable[[str], tuple[int, str]] | None = None, ssh_key: str | None = None):
    """Everything the checks read: the plan, its recipe, the local credentials, the store and run.json."""
    from infra.preflight_checks import Context, profiles
    from trainer.config import validate_resolved
    from worker_contract.env import EnvError, default_store_url, load_env, redact
    from worker_contract.manifest import load_manifest
    from worker_contract.store import NotFound, open_store

    known = profiles()
    if profile not in known:
        raise ValueError(f"{PROFILE_VAR}={profile!r} is not a profile; known: {', '.join(sorted(known))}")
    cfg = validate_resolved(plan.recipe, f"the launch plan's recipe {plan.recipe.get('name')!r}")
    base = dict(os.environ if env is None else env)
    env_path = Path(env_file) if env_file else REPO_ROOT / ".r2env"
    env_error = None
    try:
        effective = load_env(base, env_file=env_file, repo_root=REPO_ROOT)
    except EnvError as e:
        effective, env_error = base, str(e)
    url = store or cfg.store or default_store_url(effective, REPO_ROOT)
    host = host or plan.host
    box_error = None
    if host:
        try:  # one connection attempt: an unreachable box fails `box.ssh`, and the box checks say "not checked"
            run_box = run_box or ssh_runner(host, ssh_key)
            rc, _ = run_box("true")
            if rc != 0:
                box_error = f"`true` exited {rc}"
        except Exception as e:
            box_error = f"{type(e).__name__}: {redact(str(e))[:200]}"
    local_hf = hf_dir or _local_hf_dir(plan, cfg)
    ctx = Context(plan=plan, cfg=cfg, profile=known[profile], env=effective, env_file=env_path,
                  env_error=env_error, store_url=url, hf_dir=Path(local_hf) if local_hf else None,
                  run_box=None if box_error else run_box)
    if host:
        ctx.facts["box"] = (host, box_error)
    try:
        ctx.store = open_store(url, effective)
        ctx.manifest = load_manifest(ctx.store, plan.run)
    except NotFound:
        ctx.manifest = None
    except Exception as e:  # reported by the bucket check, redacted
        ctx.facts["store_error"] = f"{url}: {type(e).__name__}: {redact(str(e))[:300]}"
    if ctx.hf_dir is None and ctx.store is not None and "store_error" not in ctx.facts:
        ctx.hf_dir = _hf_dir_from_shared_base(ctx)
    return ctx


def _hf_dir_from_shared_base(ctx) -> Path | None:
    """The identity files (config, tokenizer, chat template) of a shared base in the bucket (bases/<name>/),
    when it holds the recipe's model, fetched to a temporary directory for the model-identity checks."""
    import tempfile

    from infra.psqa_setup import BASE_NAME, read_manifest
    from worker_contract import layout

    try:
        base = read_manifest(ctx.store, BASE_NAME)
    except Exception:  # an unreadable base is the launch's problem to report, not a preflight crash
        return None
    if base is None or base.hf_id != ctx.cfg.model.hf_id:
        return None
    tmp = tempfile.TemporaryDirectory(prefix="stoa-preflight-")
    ctx.facts["tmp_hf"] = tmp  # removed when the context goes
    for rel in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if f"hf/{rel}" in base.files:
            ctx.store.download_file(layout.base_file_key(BASE_NAME, "hf", rel), Path(tmp.name) / rel)
    ctx.facts["hf_source"] = f"bases/{BASE_NAME} in the bucket"
    return Path(tmp.name) if (Path(tmp.name) / "config.json").is_file() else None


#: checks of slime's command line (flags, its dashboard, its tree): the native engine has none of them; its
#: learner runs trainer/algo.py on the recipe's values, which `engine` checks against the profile instead
SLIME_ONLY = frozenset({"check_contract_agrees", "check_save_interval", "check_dual_clip", "check_gate",
                        "check_reducer", "check_no_save_hf", "check_algo", "check_batch", "check_ray_dashboard",
                        "check_slime"})


def _native_row(ctx):
    """The recipe's values the profile pins (objective, batch, save interval) against the launch's: what the
    slime-flag rows check for slime, read from the recipe the native learner runs."""
    from infra.preflight_checks import FLAG_KEYS, Row, recipe_value

    a, p = ctx.cfg.algo, ctx.profile
    want: dict[str, object] = {f"algo.{k}": v for k, v in p.algo.items()}
    if p.batch_groups is not None:
        want["algo.groups_per_step"] = p.batch_groups
    want.update({key: p.fixed_flags[flag] for key, flag in FLAG_KEYS.items() if flag in p.fixed_flags})
    seen = {k: recipe_value(ctx.cfg, k) for k in want}
    bad = [k for k, v in want.items() if float(seen[k]) != float(v)]
    if a.eps_clip_c <= 1:
        bad.append("algo.eps_clip_c")
    return Row(check="engine", status="FAIL" if bad else "PASS",
               seen="native: " + " ".join(f"{k}={v}" for k, v in {**seen, "algo.eps_clip_c": a.eps_clip_c}.items()),
               required=" ".join(f"{k}={v}" for k, v in want.items()) + " eps_clip_c>1 (trainer/algo.py: DPPO "
               "gate, dual clip, Dr.GRPO reducer, k3 KL)",
               fix="" if not bad else f"set {', '.join(dict.fromkeys(bad))} as required (the {p.recipe} recipe's "
               "values)")


def run_checks(ctx) -> list:
    """Every check of the profile, in order; a check that crashes is a FAIL row naming the crash."""
    from infra.preflight_checks import Row
    from worker_contract.env import redact

    rows = []
    native = ctx.cfg.train.engine == "native"
    if native:
        rows.append(_native_row(ctx))
    for fn, applies, needs in _checks():
        if not applies(ctx.profile) or (needs == "host" and "box" not in ctx.facts):
            continue
        if native and fn.__name__ in SLIME_ONLY:
            continue
        if needs == "box" and ctx.run_box is None:
            if "box" in ctx.facts:  # a host was given but did not answer: box.ssh failed, these wait on it
                rows.append(Row(check=fn.__name__.replace("check_", "box.", 1), status="WARN",
                                seen="not checked (no SSH connection to the box)", required="-"))
            continue
        try:
            row = fn(ctx)
        except Exception as e:  # a check must never hide the others
            row = Row(check=fn.__name__.removeprefix("check_"), status="FAIL",
                      seen=f"check crashed: {type(e).__name__}: {e}", required="-",
                      fix="fix the input named above (the check could not read it)")
        rows.append(row.model_copy(update={k: redact(getattr(row, k)) for k in ("seen", "required", "fix")}))
    return rows


def render_rows(rows, profile: str, secrets: list[str]) -> str:
    """Fixed-width text (a pipe-friendly table); refuses to return text holding a secret."""
    w = max((len(r.check) for r in rows), default=10)
    lines = [f"stoa preflight, profile {profile}", f"{'':4}  {'check':<{w}}  seen  ->  required"]
    for r in rows:
        lines.append(f"{r.status:<4}  {r.check:<{w}}  {r.seen}  ->  {r.required}")
        if r.status == "FAIL" and r.fix:
            lines.append(f"{'':4}  {'':<{w}}  fix: {r.fix}")
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "WARN", "FAIL")}
    verdict = "do NOT launch" if counts["FAIL"] else "the launch may go ahead"
    lines.append(f"{counts['PASS']} PASS, {counts['WARN']} WARN, {counts['FAIL']} FAIL: {verdict}")
    text = "\n".join(lines) + "\n"
    if any(s and s in text for s in secrets):
        raise AssertionError("a credential reached the preflight report; refusing to print it")
    return text


def _secrets(env: Mapping[str, str]) -> list[str]:
    from worker_contract.env import SECRET_VARS

    return [v for k, v in env.items() if k in SECRET_VARS and v and len(v) >= 4]


def plan_from_recipe(recipe: str, run: str | None, host: str | None, env: Mapping[str, str],
                     env_file: str | None = None):
    """Resolve the launch here exactly as the launcher does (infra.launch_gpu.build_plan), without a dry run."""
    from infra.launch_gpu import build_plan, resolve_store
    from trainer.config import resolve
    from worker_contract.env import EnvError, load_env

    if run is not None:  # a run id that is no bucket prefix is refused here, before any check reads it
        from worker_contract.layout import RUN_ID_RE

        if not RUN_ID_RE.fullmatch(run):
            raise ValueError(f"--run={run!r} is not a valid run id: use 1-63 characters of lowercase letters, "
                             "digits, '.', '_' or '-', starting with a letter or digit (for example "
                             "--run gsm8k-2026-11-30a)")
    try:
        effective = load_env(env, env_file=env_file, repo_root=REPO_ROOT)
    except EnvError:
        effective = dict(env)  # the credentials check reports it
    cfg = resolve(recipe, effective, {"run": run})
    return build_plan(cfg, host=host, remote_dir=cfg.launch.remote_dir, env=effective,
                      store=resolve_store(cfg, effective))


def read_plan(args, stdin, env: Mapping[str, str]):
    """The plan: resolved from --recipe, else parsed from the dry run on stdin."""
    from infra.launch_plan import PlanError, parse_plan

    if args.recipe:
        return plan_from_recipe(args.recipe, args.run, args.host, env, args.env_file)
    if stdin.isatty():
        raise ValueError("nothing on stdin: pipe a dry run into it (DRL_DRY_RUN=1 make gsm8k RUN=<id> | "
                         "nox -s preflight) or pass --recipe gsm8k|psqa")
    text = stdin.read()
    if "# mode: embedded" in text and "BEGIN STOA LAUNCH PLAN" not in text:
        raise PlanError("this dry run is the embedded default (no GPU box, nothing to preflight); the preflight "
                        "checks a trainer launch: add HOST=user@box (DRL_DRY_RUN=1 make gsm8k RUN=<id> "
                        "HOST=user@box | nox -s preflight), or run the dry run on a GPU box with R2 credentials")
    return parse_plan(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m infra.preflight", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", help="resolve this recipe here instead of reading a dry run on stdin")
    p.add_argument("--run", help="run id with --recipe (default DRL_RUN)")
    p.add_argument("--profile", help=f"quickstart | fleet (default ${PROFILE_VAR}, else by recipe)")
    p.add_argument("--host", help="GPU box user@host for the box checks (default: the plan's host)")
    p.add_argument("--ssh-key", help="SSH private key for the box")
    p.add_argument("--hf-dir", help="local HF checkpoint dir for the model-identity checks")
    p.add_argument("--env-file", help="credentials file (default .r2env in the repo root, mode 0600)")
    p.add_argument("--store", help="store URL (default: the plan's, else DRL_STORE / R2 / file store)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None, stdin=None, env: Mapping[str, str] | None = None) -> int:
    args = parse_args(argv)
    from infra.launch_plan import PlanError

    env = dict(os.environ if env is None else env)
    try:
        from infra.preflight_checks import profiles

        known = profiles()
        if args.profile and args.profile not in known:
            raise ValueError(f"--profile={args.profile!r} is not a profile; known: {', '.join(sorted(known))}")
        plan = read_plan(args, stdin or sys.stdin, env)
        # by default the profile the plan's recipe names in its preflight section
        profile = args.profile or env.get(PROFILE_VAR) or (plan.recipe.get("preflight") or {}).get("profile",
                                                                                                   "quickstart")
        ctx = build_context(plan, profile=profile, env=env, env_file=args.env_file, store=args.store,
                            hf_dir=args.hf_dir, host=args.host, ssh_key=args.ssh_key)
    except (PlanError, ValueError) as e:
        from worker_contract.env import redact

        print(f"preflight: {redact(str(e))}", file=sys.stderr)
        return 2
    rows = run_checks(ctx)
    secrets = _secrets(ctx.env)
    if args.json:
        import json

        text = json.dumps({"profile": profile, "rows": [r.model_dump() for r in rows]}, indent=2) + "\n"
        assert not any(s in text for s in secrets), "a credential reached the preflight report"
    else:
        text = render_rows(rows, profile, secrets)
    sys.stdout.write(text)
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    from worker_contract.cli import run_main

    sys.exit(run_main(main, "python -m infra.preflight"))
