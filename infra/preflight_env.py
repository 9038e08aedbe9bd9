"""Preflight checks of what surrounds the launch: credentials, the bucket, the run id, the base anchor, and
the GPU box (over SSH, when a host is given). Each returns one `Row`; see `infra.preflight_checks`.
"""

from __future__ import annotations

import contextlib
import functools
import re
import shlex
import stat
import uuid

from infra import box_check, slime_launch
from infra.preflight_checks import Context, Row, _row, hf_config
from worker_contract import layout
from worker_contract.env import R2_VARS, redact

#: RunManifest fields the run-id check compares; n_samples / plane / kv_mode / run are contract.agree's
RESUME_FIELDS = ("task", "temperature", "top_p", "max_new_tokens", "staleness", "anchor_interval")


def _scheme(url: str) -> str:
    return url.split("://", 1)[0]


def check_credentials(ctx: Context) -> Row:
    """The store's credentials are present, and every file that holds them is private (0600)."""
    scheme = _scheme(ctx.store_url)
    problems, seen = [], []
    if ctx.env_error:
        problems.append(ctx.env_error)
    elif ctx.env_file is not None and ctx.env_file.exists():
        mode = stat.S_IMODE(ctx.env_file.stat().st_mode)
        seen.append(f"{ctx.env_file} mode {mode:04o}")
    if scheme == "r2":
        missing = [v for v in R2_VARS if not ctx.env.get(v, "").strip()]
        seen.append("R2 values: " + ("missing " + ", ".join(missing) if missing else "all four set"))
        if missing:
            problems.append(f"missing {', '.join(missing)}")
    elif scheme == "s3":
        have = any(ctx.env.get(k) for k in ("R2_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID", "AWS_PROFILE"))
        seen.append("S3 keys " + ("set" if have else "missing"))
        if not have:
            problems.append("no R2_ACCESS_KEY_ID / AWS_ACCESS_KEY_ID")
    else:
        seen.append("file store: no credentials needed")
    if ctx.run_box is not None:
        path = f"{ctx.plan.remote_dir}/.r2env"
        rc, out = ctx.run_box(f"stat -c %a {shlex.quote(path)} 2>/dev/null || echo absent")
        box_mode = out.strip() or "absent"
        seen.append(f"box {path} mode {box_mode}")
        if box_mode not in ("600", "400", "absent"):
            problems.append(f"box {path} mode {box_mode}")
    fix = ("put R2_ACCOUNT_ID, R2_ACCESS_KEY_ID, R2_SECRET_ACCESS_KEY, R2_BUCKET in .r2env (see docs/r2-setup.md) "
           "and make every credentials file private: chmod 600 .r2env"
           + (f" (and on the box: chmod 600 {ctx.plan.remote_dir}/.r2env)" if ctx.run_box else ""))
    return _row("credentials", not problems, "; ".join(seen + problems), "present, mode 0600", fix)


def check_store(ctx: Context) -> Row:
    """Workers on other machines can reach the store: a fleet (or a remote box) needs R2 / S3."""
    remote = ctx.profile.remote_store or ctx.plan.host is not None
    ok = not remote or _scheme(ctx.store_url) in ("r2", "s3")
    return _row("store", ok, ctx.store_url, "r2://<bucket> or s3://<bucket>" if remote else "any store",
                "fill .r2env with the four R2 values (the store then defaults to r2://$R2_BUCKET) or set "
                "DRL_STORE=r2://<bucket>: workers on other machines cannot reach a file store")


def check_bucket(ctx: Context) -> Row:
    """Reachable and writable: a create-only probe object under the run, read back, then removed."""
    key = layout.probe_key(ctx.plan.run, f"preflight-{uuid.uuid4().hex[:12]}")
    fix = ("check R2_BUCKET names an existing bucket and that the API token has Object Read & Write on it "
           "(R2 dashboard > API tokens); for s3:// check DRL_S3_ENDPOINT")
    if ctx.store is None:
        return _row("bucket", False, ctx.facts.get("store_error", "store not opened"), "reachable and writable", fix)
    body = b"stoa preflight probe: safe to delete\n"
    try:
        ctx.store.put_if_absent(key, body)
        try:
            back = ctx.store.get(key)
        finally:
            ctx.store.delete(key)
        gone = ctx.store.head(key) is None
    except Exception as e:  # any failure here is the finding itself; the message is shown redacted
        if _scheme(ctx.store_url) in ("r2", "s3") and "HTTP " not in str(e) and "does not exist" not in str(e):
            # no answer at all, not a refusal (a file store's failure is the folder's, which the message names)
            fix = ("the store did not answer: check that this machine reaches it (network, proxy) and the endpoint "
                   "(R2_ACCOUNT_ID names the account's https://<account>.r2.cloudflarestorage.com; for s3:// "
                   "DRL_S3_ENDPOINT)")
        return _row("bucket", False, f"{ctx.store_url}: {type(e).__name__}: {redact(str(e))[:300]}",
                    "reachable and writable", fix)
    ok = back == body and gone
    _remove_empty_probe_dirs(ctx)
    ctx.bucket_ok = ok
    return _row("bucket", ok, f"{ctx.store_url}: probe written, read back, removed" if ok else
                f"{ctx.store_url}: probe {'did not read back' if back != body else 'was not removed'}",
                "reachable and writable", fix)


def _remove_empty_probe_dirs(ctx: Context) -> None:
    """A file store keeps the folders a probe's key made (`<run>/probes/`, and `<run>/` of a fresh run): the
    preflight removes them when they are empty, so it leaves the store as it found it."""
    from worker_contract.store.file import FileStore

    if isinstance(ctx.store, FileStore):
        run_dir = ctx.store.root / ctx.plan.run
        for d in (run_dir / "probes", run_dir):
            with contextlib.suppress(OSError):  # not empty (a real run's), or already gone
                d.rmdir()


def _requested(ctx: Context) -> dict[str, object]:
    a = ctx.cfg.algo
    out: dict[str, object] = {"task": ctx.cfg.task, "temperature": a.temperature, "top_p": a.top_p,
                              "max_new_tokens": a.max_new_tokens, "staleness": a.staleness,
                              "anchor_interval": ctx.cfg.train.anchor_interval}
    return out


def check_run_id(ctx: Context) -> Row:
    """Fresh, or resumable: run.json's contract is the one this launch would publish."""
    run = ctx.plan.run
    if not ctx.bucket_ok:
        return Row(check="run_id", status="WARN", seen=f"{run}: not checked (bucket check failed)",
                   required="fresh, or identical contract")
    if ctx.manifest is None:
        return _row("run_id", True, f"{run}: fresh (no run.json)", "fresh, or identical contract", "")
    want = _requested(ctx)
    diff = [(k, getattr(ctx.manifest, k), v) for k, v in want.items() if getattr(ctx.manifest, k) != v]
    seen = (f"{run}: published, " + ("contract identical (resume)" if not diff else
            "; ".join(f"{k} published {a!r}, launch {b!r}" for k, a, b in diff)))
    return _row("run_id", not diff, seen, "fresh, or identical contract",
                f"choose a fresh run id (DRL_RUN={run}-b), or launch with the values run.json holds")


def check_base_anchor(ctx: Context) -> Row:
    """v1 (or a later anchor) is in the bucket, or the launch can publish it from the model it names."""
    if not ctx.bucket_ok:
        return Row(check="base_anchor", status="WARN", seen="not checked (bucket check failed)",
                   required="present or publishable")
    from worker_contract.anchor import anchor_versions
    from worker_contract.pointer import PointerError, read_pointer

    run = ctx.plan.run
    anchors = anchor_versions(ctx.store, run)
    try:
        ptr, _ = read_pointer(ctx.store, run, ctx.manifest.trainer_public_key if ctx.manifest else None)
    except PointerError as e:
        return _row("base_anchor", False, f"current.json does not verify: {e}", "present or publishable",
                    f"the run's pointer is not signed by the key in its run.json: start a fresh DRL_RUN={run}-b")
    pointer = ptr.version if ptr else None
    usable = [v for v in anchors if pointer is None or v <= pointer]
    if usable:
        return _row("base_anchor", True, f"present: v{usable[-1]}", "present or publishable", "")
    m = ctx.cfg.model
    source = m.path or m.hf_id
    seen = f"absent; launch publishes v1 from {source}" if source else "absent, and the recipe names no model"
    if pointer is not None:
        seen = f"pointer v{pointer} but no anchor at or below it"
    return _row("base_anchor", bool(source) and pointer is None, seen, "present or publishable",
                "set model.hf_id in the recipe or pass MODEL=/path/to/hf-dir; a run whose pointer has no anchor "
                "is damaged: start a fresh DRL_RUN")


# -- the box --------------------------------------------------------------------------------------------
def check_ssh(ctx: Context) -> Row:
    """The box answers over SSH (only when a host is given)."""
    host, error = ctx.facts["box"]
    return _row("box.ssh", error is None, f"{host}: " + ("connected" if error is None else error),
                "reachable with the SSH key", f"check HOST={host} and SSH_KEY: `ssh {host} true` must work "
                "(the key in ~/.ssh or SSH_KEY=/path/to/key, the box up, port 22 or HOST=user@box:port)")


def check_gpu(ctx: Context) -> Row:
    assert ctx.run_box is not None
    rc, out = ctx.run_box("nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1")
    gpus = [ln.strip() for ln in out.splitlines() if ln.strip()] if rc == 0 else []
    need = ctx.cfg.compute.tensor_parallel
    mib = [float(m.group(1)) for g in gpus if (m := re.search(r",\s*([\d.]+)\s*MiB\s*$", g))]
    if mib:
        ctx.facts["gpu_gib"] = min(mib) / 1024  # the smallest GPU bounds the learner
    seen = "; ".join(gpus) if gpus else f"none (nvidia-smi rc {rc}: {out.strip()[:120]})"
    return _row("box.gpu", len(gpus) >= need, seen, f"at least {need} CUDA GPU(s)",
                "use a GPU box with the NVIDIA driver and the slime image (nvidia-smi must list the GPU); "
                "in a container, start it with --gpus all")


def check_gpu_memory(ctx: Context) -> Row:
    """The learner's micro-batches fit the box's GPU, by an estimate (infra/learner_memory.py): a warning,
    since an out-of-memory error would only come after the download, the conversion and the launch."""
    from infra.learner_memory import USABLE, is_moe, learner_peak_gib, tokens_per_micro_batch, tokens_that_fit

    cfg, src = hf_config(ctx)
    gpu = ctx.facts.get("gpu_gib")
    compute, new_tokens = ctx.cfg.compute, ctx.cfg.algo.max_new_tokens
    if cfg is not None and gpu is not None and is_moe(cfg):
        return _moe_gpu_memory(ctx, cfg, gpu)
    est = learner_peak_gib(cfg, compute, new_tokens) if cfg is not None else None
    if gpu is None or est is None:
        why = "no GPU memory from nvidia-smi" if gpu is None else f"no dense-decoder estimate ({src})"
        return _row("box.gpu_memory", False, f"not estimated: {why}", "the learner's estimate within the GPU",
                    "check the GPU with nvidia-smi on the box", warn=True)
    tokens = tokens_per_micro_batch(compute, new_tokens)
    fit = tokens_that_fit(cfg, compute, gpu)
    return _row("box.gpu_memory", est <= USABLE * gpu,
                f"~{est:.0f} GiB per GPU at {tokens} tokens per micro-batch; the GPU has {gpu:.0f} GiB",
                f"<= {USABLE * gpu:.0f} GiB ({USABLE:.0%})",
                f"set compute.max_tokens_per_gpu: {fit} in the recipe (the largest that fits by this estimate), "
                "or rent a GPU with more memory", warn=True)


def _moe_gpu_memory(ctx: Context, cfg: dict, gpu: float) -> Row:
    """A mixture-of-experts model (the fleet model) under the recipe's memory plan, and the plan that fits each
    card users rent (infra/learner_memory.py, fitted to the H200 measurements)."""
    from infra import learner_memory as lm

    compute, algo = ctx.cfg.compute, ctx.cfg.algo
    params = lm.total_params(cfg)
    if params is None:
        return _row("box.gpu_memory", False, f"not estimated: transformers cannot build {cfg.get('model_type')!r}",
                    "the learner's estimate within the GPU", "check the model's config.json", warn=True)
    tokens, tp = lm.tokens_per_micro_batch(compute, algo.max_new_tokens), compute.tensor_parallel
    moments = functools.partial(slime_launch.moment_bytes, ctx.cfg)  # float32 on slime with CPU offload
    est = lm.moe_peak_gib(cfg, params, tokens, offload=ctx.cfg.optim.offload,
                          recompute=compute.gradient_checkpointing, moment_bytes=moments(), tp=tp)
    host = params * ctx.cfg.optim.offload * slime_launch.host_optimizer_bytes(ctx.cfg) / lm.GIB
    cards = []
    for card, gib in lm.CARDS.items():
        plan = lm.moe_plan_for(cfg, params, tokens, gib, tp, moment_bytes=moments)
        fits = lm.moe_tokens_that_fit(cfg, params, gib, tp)
        cards.append(f"{card}: offload {plan[0]:g}{' + recompute' if plan[1] else ''} (~{plan[2]:.0f} GiB)" if plan
                     else f"{card}: none at this batch (recompute and full offload fit {fits} tokens per "
                          "micro-batch)" if fits else
                     f"{card}: none at any batch (the states that stay on the GPU alone do not fit; tensor "
                     "parallel across GPUs would)")
    fit = lm.moe_plan_for(cfg, params, tokens, gpu, tp, moment_bytes=moments)
    leanest = lm.moe_tokens_that_fit(cfg, params, gpu, tp)
    fix = (f"set {lm.describe_plan(fit[0], fit[1])} in the recipe (~{fit[2]:.0f} GiB)" if fit else
           f"lower compute.micro_batch_size or set compute.max_tokens_per_gpu: {leanest} with the leanest plan, or "
           "rent a larger GPU" if leanest else
           "rent a GPU with more memory, or set compute.tensor_parallel to spread the model over this box's GPUs")
    plan = (f"offload {ctx.cfg.optim.offload:g}, {'recompute' if compute.gradient_checkpointing else 'no recompute'}, "
            f"{'float32' if moments() == 4 else 'bfloat16'} moments; ~{host:.0f} GiB of optimizer state in host memory")
    return _row("box.gpu_memory", est <= lm.USABLE * gpu,
                f"~{est:.0f} GiB per GPU ({params / 1e9:.1f} B parameters, {plan}) at {tokens} tokens per "
                f"micro-batch; the GPU has {gpu:.0f} GiB. Plans by card: {'; '.join(cards)}",
                f"<= {lm.USABLE * gpu:.0f} GiB ({lm.USABLE:.0%})", fix, warn=True)


def check_disk(ctx: Context) -> Row:
    """Free disk plus what the launch reuses there (the models, this run's own directory: infra/box_check.py's
    `reused_gb`) against the recipe's figure."""
    assert ctx.run_box is not None
    paths = slime_launch.BoxPaths(remote_dir=ctx.plan.remote_dir, run=ctx.plan.run)
    d = shlex.quote(ctx.plan.remote_dir)
    reused = " ".join(shlex.quote(p) for p in (*slime_launch.reused_model_dirs(ctx.cfg, paths), paths.state_dir))
    rc, out = ctx.run_box(f'd={d}; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; df -Pk "$d" | tail -1; '
                          f"du -sk --apparent-size {reused} 2>/dev/null | awk '{{s += $1}} END {{print s + 0}}'")
    try:
        lines = out.strip().splitlines()
        free_gb = int(lines[0].split()[3]) * 1024 / 1e9
        reused_gb = int(lines[1]) * 1024 / 1e9 if len(lines) > 1 else 0.0
    except (IndexError, ValueError):
        return _row("box.disk", False, f"df failed (rc {rc})", "", "check the box: df -h must work", warn=True)
    try:
        override = box_check.min_free_override(ctx.env)  # as the launch forwards it to the box
    except ValueError as e:
        return _row("box.disk", False, str(e), "a number of GB", "fix or unset DRL_MIN_FREE_GB")
    need = override if override is not None else slime_launch.disk_floor_gb(ctx.cfg, hf_config(ctx)[0])
    ckpts = ctx.cfg.checkpoint.keep
    reuse = f" and {reused_gb:.0f} GB of its model and this run's files it reuses" if reused_gb >= 0.5 else ""
    why = ("DRL_MIN_FREE_GB" if override is not None else f"the model, its Megatron copy, {ckpts} + 1 "
           f"{ctx.cfg.train.engine}-engine checkpoints (checkpoint.keep: {ckpts}) and logs")
    return _row("box.disk", free_gb + reused_gb >= need, f"{free_gb:.0f} GB free under {ctx.plan.remote_dir}{reuse}",
                f">= {need:.0f} GB", f"free disk on the box or rent a larger disk (need {need:.0f} GB: {why})")


def check_ray_dashboard(ctx: Context) -> Row:
    """A Ray dashboard already running must listen on localhost only; the launch itself submits there."""
    assert ctx.run_box is not None
    port = slime_launch.DASHBOARD.rsplit(":", 1)[1]
    rc, out = ctx.run_box(f"(ss -ltnH 2>/dev/null || netstat -ltn 2>/dev/null) | grep -E '[:.]{port}\\b' || true")
    listeners = [ln.split()[3] if len(ln.split()) > 3 else ln for ln in out.splitlines() if ln.strip()]
    public = [a for a in listeners if not a.startswith(("127.", "[::1]", "::1", "localhost"))]
    cmd = ctx.plan.command
    address_ok = "--address" not in cmd or cmd[cmd.index("--address") + 1:][:1] == [slime_launch.DASHBOARD]
    seen = ("listening on " + ", ".join(listeners)) if listeners else "not running (the launch starts it)"
    if not address_ok:
        seen += "; launch command does not submit to " + slime_launch.DASHBOARD
    return _row("box.ray_dashboard", not public and address_ok, seen, f"127.0.0.1:{port} only",
                "stop the exposed Ray (`ray stop` on the box); the launch restarts it with "
                "--dashboard-host 127.0.0.1 (reach it through `ssh -L 8265:127.0.0.1:8265`)")


def check_slime(ctx: Context) -> Row:
    """The box's slime: its commit, and what our patch set does there, read off slime's code by
    infra/patches/probes.py (sent as program text, as infra/box_check.py is): each patch patched already,
    not needed (upstream has it), or to apply at launch. Our patch text in place with the behaviour missing
    (a hook that is never called) fails; a missing slime is left to the launch's check_box."""
    import json
    from pathlib import Path

    from infra.patches import probes

    assert ctx.run_box is not None
    if ctx.cfg.train.engine != "slime":
        return _row("box.slime", True, f"not used (train.engine {ctx.cfg.train.engine})", "-", "")
    tree = ctx.cfg.launch.slime_dir
    src = (Path(probes.__file__)).read_text()
    rc, out = ctx.run_box(f"test -d {shlex.quote(tree)} && python3 -c {shlex.quote(src)} --tree {shlex.quote(tree)}")
    try:
        rep = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return _row("box.slime", False, f"no slime checkout read at {tree} (rc {rc})", "slime with our patch set",
                    "use the slimerl/slime image (slime at /root/slime) or set launch.slime_dir", warn=True)
    if not rep["is_slime"]:
        return _row("box.slime", False, f"{tree} is not a slime checkout (no {probes.ARGUMENTS})",
                    "slime with our patch set", "point launch.slime_dir at the image's slime checkout")
    verdicts = rep["verdicts"]
    broken = [f"{name}: {why}" for name, (state, why) in verdicts.items() if state == "broken"]
    words = {"patched": "patched", "upstream": "not needed (slime does it)", "to apply": "to apply at launch"}
    seen = f"slime {rep['commit']}: " + "; ".join(
        f"{name.removesuffix('.patch')} {words.get(state, state)}" for name, (state, _) in verdicts.items())
    return _row("box.slime", not broken, seen + ("; " + "; ".join(broken) if broken else ""),
                "each patch patched, not needed, or applicable",
                f"restore slime's files and relaunch, which re-applies the patches: cd {tree} && git checkout -- "
                + " ".join(sorted({f for name in verdicts for f in probes.FILES[name]})))


__all__ = ["check_credentials", "check_store", "check_bucket", "check_run_id", "check_base_anchor",
           "check_ssh", "check_gpu", "check_gpu_memory", "check_disk", "check_ray_dashboard", "check_slime", "hf_config"]
