"""The preflight's checks: each reads the resolved launch (`Context`) and returns one `Row`.

A check that depends on something an earlier check found broken (an unreachable bucket, no HF config here)
reports WARN "not checked" rather than a second FAIL, so every problem fails exactly one row, the row whose
fix solves it. Nothing here prints: rows go through `redact` in `infra.preflight` before anyone sees them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from infra import slime_launch
from infra.launch_plan import LaunchPlan
from trainer.config import RecipeConfig

Status = Literal["PASS", "FAIL", "WARN"]


class Row(BaseModel):
    """One line of the preflight report."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    check: str
    """Check name (stable; tests and scripts refer to it)."""
    status: Status
    """PASS, FAIL (the launch must not go ahead) or WARN (could not check, or worth a look)."""
    seen: str
    """The value found."""
    required: str
    """The value the profile requires."""
    fix: str = ""
    """For a FAIL, the exact change that makes it pass."""


class Profile(BaseModel):
    """What a launch profile requires: built from one recipe's `preflight` section and that recipe's own values
    (`profile_of`), so a profile never copies a recipe value."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str
    """Profile name (DRL_PREFLIGHT_PROFILE): the recipe's preflight.profile."""
    recipe: str
    """The recipe this profile launches."""
    n_samples: int | None = None
    """DRL_N_SAMPLES every worker must match (None: not pinned)."""
    plane: str | None = None
    """DRL_PULSE_PLANE (None: not pinned)."""
    kv_mode: str | None = None
    """DRL_KV_MODE the workers must run (None: not constrained)."""
    fixed_flags: dict[str, str] = {}
    """slime flags whose values the profile fixes."""
    algo: dict[str, float] = {}
    """Recipe `algo` values the profile fixes (staleness, reuse cap, ref-KL)."""
    batch_groups: int | None = None
    """Prompt groups per step the profile fixes (each of n_samples samples)."""
    remote_store: bool = False
    """Workers run elsewhere: the store must be r2:// or s3://."""


#: pinned recipe key -> the slime flag that carries it (the native engine's row reads the recipe key itself)
FLAG_KEYS = {"checkpoint.interval": "--save-interval", "algo.eps_clip": "--eps-clip",
          "algo.eps_clip_high": "--eps-clip-high", "algo.eps_clip_c": "--eps-clip-c"}
_ALGO = ("algo.staleness", "algo.reuse_cap", "algo.kl_coef")


def recipe_value(cfg: RecipeConfig, dotted: str):
    """A resolved recipe's value at a dotted key (`algo.eps_clip`)."""
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def profile_of(recipe: str) -> Profile:
    """The profile of a registered recipe: its `preflight` section, the pinned keys' values read from the recipe
    itself (its file over the defaults; no environment)."""
    from trainer.config import resolve

    cfg = resolve(recipe, env={})
    sec, pinned = cfg.preflight, set(cfg.preflight.pinned)
    return Profile(name=sec.profile, recipe=recipe,
                   n_samples=cfg.contract.n_samples if "contract.n_samples" in pinned else None,
                   plane=cfg.contract.plane if "contract.plane" in pinned else None,
                   kv_mode=cfg.contract.kv_mode if "contract.kv_mode" in pinned else None,
                   fixed_flags={flag: _fmt(recipe_value(cfg, k)) for k, flag in FLAG_KEYS.items() if k in pinned},
                   algo={k.split(".")[1]: recipe_value(cfg, k) for k in _ALGO if k in pinned},
                   batch_groups=cfg.algo.groups_per_step if "algo.groups_per_step" in pinned else None,
                   remote_store=sec.remote_store)


def profiles() -> dict[str, Profile]:
    """profile name -> Profile, one per recipe under runs/ (two recipes naming one profile: the first by name)."""
    from trainer.config import RECIPES

    out: dict[str, Profile] = {}
    for recipe in sorted(RECIPES):
        prof = profile_of(recipe)
        out.setdefault(prof.name, prof)
    return out


@dataclass
class Context:
    """Everything the checks read; built once by `infra.preflight.build_context`."""

    plan: LaunchPlan
    cfg: RecipeConfig
    profile: Profile
    env: dict[str, str]
    """The effective local environment (env file + os.environ). Holds secrets: never printed."""
    env_file: Path | None
    env_error: str | None
    store_url: str
    hf_dir: Path | None = None
    run_box: Callable[[str], tuple[int, str]] | None = None
    """Runs a shell command on the box (rc, stdout); None without a host."""
    store: Any = None
    bucket_ok: bool = False
    manifest: Any = None
    facts: dict[str, Any] = field(default_factory=dict)

    def flag(self, name: str) -> str | bool | None:
        """The value after `name` in the slime flags, True for a flag with no value, None if absent."""
        args = self.plan.slime_args
        if name not in args:
            return None
        i = args.index(name)
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            return args[i + 1]
        return True


def _row(check: str, ok: bool, seen: object, required: object, fix: str, warn: bool = False) -> Row:
    status: Status = "PASS" if ok else ("WARN" if warn else "FAIL")
    return Row(check=check, status=status, seen=str(seen), required=str(required), fix="" if ok else fix)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _num_eq(a: object, b: object) -> bool:
    try:
        return float(a) == float(b)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


# -- the contract ---------------------------------------------------------------------------------------
def check_n_samples(ctx: Context) -> Row:
    n = ctx.cfg.contract.n_samples
    return _row("contract.n_samples", n == ctx.profile.n_samples, f"DRL_N_SAMPLES={n}",
                f"DRL_N_SAMPLES={ctx.profile.n_samples}",
                f"export DRL_N_SAMPLES={ctx.profile.n_samples} (every worker uses the same group size; "
                f"recipe contract.n_samples: {ctx.profile.n_samples})")


def check_plane(ctx: Context) -> Row:
    p = ctx.cfg.contract.plane
    return _row("contract.plane", p == ctx.profile.plane, f"DRL_PULSE_PLANE={p}",
                f"DRL_PULSE_PLANE={ctx.profile.plane}",
                f"export DRL_PULSE_PLANE={ctx.profile.plane} (the {ctx.profile.name} profile publishes that plane)")


def check_kv_mode(ctx: Context) -> Row:
    want, kv = ctx.profile.kv_mode, ctx.cfg.contract.kv_mode
    if want is None:
        return _row("contract.kv_mode", True, f"DRL_KV_MODE={kv or '(unset)'}", "any", "")
    return _row("contract.kv_mode", kv == want, f"DRL_KV_MODE={kv or '(unset)'}", f"DRL_KV_MODE={want}",
                f"export DRL_KV_MODE={want} (the fleet's workers share prompt prefixes in a paged KV cache)")


def check_contract_agrees(ctx: Context) -> Row:
    """The environment, the recipe, the launch command and run.json (if published) name one contract."""
    c, env, m = ctx.cfg.contract, ctx.plan.env, ctx.manifest
    sources: dict[str, dict[str, object]] = {
        "n_samples": {"recipe": c.n_samples, "command --n-samples-per-prompt": ctx.flag("--n-samples-per-prompt")},
        "plane": {"recipe": c.plane},
        "kv_mode": {"recipe": c.kv_mode},
        "run": {"plan": ctx.plan.run, "recipe": ctx.cfg.run},
    }
    for var, name in (("DRL_N_SAMPLES", "n_samples"), ("DRL_PULSE_PLANE", "plane"), ("DRL_KV_MODE", "kv_mode"),
                      ("DRL_RUN", "run")):
        if env.get(var):
            sources[name]["env " + var] = env[var]
    meta = _job_metadata(ctx.plan.command)
    if meta.get("stoa_run"):
        sources["run"]["command metadata"] = meta["stoa_run"]
    if m is not None:
        for name in ("n_samples", "plane", "kv_mode", "run"):
            sources[name]["run.json"] = getattr(m, name)
    bad = []
    for name, values in sources.items():
        norm = {src: (str(v) if v not in (None, "") else "(unset)") for src, v in values.items()}
        if len(set(norm.values())) > 1:
            bad.append(f"{name}: " + ", ".join(f"{s}={v}" for s, v in norm.items()))
    seen = "; ".join(bad) if bad else "env, recipe, command" + (", run.json" if m is not None else "") + " agree"
    return _row("contract.agree", not bad, seen, "one value per contract field",
                "make them equal: re-run the dry run with the same DRL_* values the run was created with "
                "(run.json is fixed once published), and do not edit the printed command by hand")


def _job_metadata(command: list[str]) -> dict:
    if "--metadata-json" in command:
        try:
            return json.loads(command[command.index("--metadata-json") + 1])
        except (IndexError, ValueError):
            return {}
    return {}


# -- fixed recipe values --------------------------------------------------------------------------------
def check_save_interval(ctx: Context) -> Row:
    want = ctx.profile.fixed_flags.get("--save-interval")
    seen = ctx.flag("--save-interval")
    if want is None:
        return _row("recipe.save_interval", seen is not None, f"--save-interval {seen}", "set",
                    "set checkpoint.interval in the recipe")
    return _row("recipe.save_interval", seen == want, f"--save-interval {seen}", f"--save-interval {want}",
                f"set checkpoint.interval: {want}, the {ctx.profile.recipe} recipe's value (it is pinned)")


def check_dual_clip(ctx: Context) -> Row:
    names = ("--eps-clip", "--eps-clip-high", "--eps-clip-c")
    seen = " ".join(f"{n} {ctx.flag(n)}" for n in names)
    want = {n: ctx.profile.fixed_flags.get(n) for n in names}
    if all(v is None for v in want.values()):  # the quickstart keeps the recipe's clip, but it must be a dual clip
        c = ctx.flag("--eps-clip-c")
        return _row("recipe.dual_clip", c not in (None, True) and float(c) > 1, seen, "--eps-clip-c > 1",
                    "set algo.eps_clip_c above 1 in the recipe (dual-clip PPO)")
    ok = all(_num_eq(ctx.flag(n), v) for n, v in want.items())
    required = " ".join(f"{n} {v}" for n, v in want.items())
    return _row("recipe.dual_clip", ok, seen, required,
                "set " + ", ".join(f"algo.{n.removeprefix('--').replace('-', '_')}: {v}" for n, v in want.items()
                                   if v is not None) + f", the {ctx.profile.recipe} recipe's values (pinned)")


def check_gate(ctx: Context) -> Row:
    seen = ctx.flag("--custom-tis-function-path")
    return _row("recipe.dppo_gate", seen == slime_launch.GATE_FN, f"--custom-tis-function-path {seen}",
                slime_launch.GATE_FN, "launch through `make <recipe>` (infra/slime_launch.py sets the DPPO gate); "
                "remove any --custom-tis-function-path from launch.extra_args")


def check_reducer(ctx: Context) -> Row:
    seen = ctx.flag("--custom-pg-loss-reducer-function-path")
    return _row("recipe.drgrpo_reducer", seen == slime_launch.REDUCER_FN,
                f"--custom-pg-loss-reducer-function-path {seen}", slime_launch.REDUCER_FN,
                "launch through `make <recipe>` (infra/slime_launch.py sets the Dr.GRPO reducer); remove any "
                "--custom-pg-loss-reducer-function-path from launch.extra_args")


def check_no_save_hf(ctx: Context) -> Row:
    seen = ctx.flag("--save-hf")
    return _row("recipe.no_save_hf", seen is None, "absent" if seen is None else f"--save-hf {seen}", "absent",
                "remove --save-hf from launch.extra_args: weights reach workers as PULSE patches, and an HF "
                "export on every save costs minutes and disk")


def check_algo(ctx: Context) -> Row:
    want = ctx.profile.algo
    seen = {k: getattr(ctx.cfg.algo, k) for k in want}
    kl_flag = ctx.flag("--kl-loss-coef")
    seen_s = " ".join(f"{k}={v}" for k, v in seen.items()) + f" --kl-loss-coef {kl_flag}"
    ok = all(_num_eq(seen[k], v) for k, v in want.items())
    if "kl_coef" in want:
        ok = ok and ctx.flag("--use-kl-loss") is True and _num_eq(kl_flag, want["kl_coef"])
    required = " ".join(f"{k}={v:g}" for k, v in want.items())
    return _row("recipe.algo", ok, seen_s, required,
                "set " + ", ".join(f"algo.{k}: {v:g}" for k, v in want.items())
                + f", the {ctx.profile.recipe} recipe's values (and no --kl-loss-coef in launch.extra_args)")


def check_batch(ctx: Context) -> Row:
    """Groups per step, and a global batch of exactly groups x samples (the group size is contract.n_samples')."""
    g, n = ctx.flag("--rollout-batch-size"), ctx.flag("--n-samples-per-prompt")
    gb = ctx.flag("--global-batch-size")
    want_g = ctx.profile.batch_groups
    try:
        whole = int(gb) == int(g) * int(n)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        whole = False
    return _row("recipe.batch", _num_eq(g, want_g) and whole, f"{g} groups x {n} samples (global batch {gb})",
                f"{want_g} groups x DRL_N_SAMPLES samples (global batch their product)",
                f"set algo.groups_per_step: {want_g} ({ctx.profile.recipe}'s value), and remove any --rollout-batch-size or "
                "--global-batch-size from launch.extra_args")


# -- model identity -------------------------------------------------------------------------------------
def hf_config(ctx: Context) -> tuple[dict | None, str]:
    """The HF config.json to check against, and where it came from."""
    if "hf_config" not in ctx.facts:
        from trainer.models.hf_io import load_hf_config

        cfg, src = None, "no HF config here (pass --hf-dir, or the box checks it at launch)"
        if ctx.hf_dir is not None and (ctx.hf_dir / "config.json").is_file():
            cfg, src = load_hf_config(ctx.hf_dir), ctx.facts.get("hf_source", str(ctx.hf_dir))
        elif ctx.cfg.model.hf_id in slime_launch.KNOWN_HF_CONFIGS:
            cfg, src = slime_launch.KNOWN_HF_CONFIGS[ctx.cfg.model.hf_id], f"known config of {ctx.cfg.model.hf_id}"
        ctx.facts["hf_config"] = (cfg, src)
    return ctx.facts["hf_config"]


def check_rotary(ctx: Context) -> Row:
    from trainer.models.hf_io import rope_theta_of

    cfg, src = hf_config(ctx)
    seen = ctx.flag("--rotary-base")
    if cfg is None:
        return Row(check="model.rotary_base", status="WARN", seen=f"--rotary-base {seen}; {src}",
                   required="the HF rope_theta")
    theta = rope_theta_of(cfg)
    if seen is None:  # the plan could not resolve the model flags here; the box derives them from rope_theta
        seen = f"(flags resolved on the box) model.rotary_base={ctx.cfg.model.rotary_base}"
        launch_ok = ctx.cfg.model.rotary_base is None or _num_eq(ctx.cfg.model.rotary_base, theta)
    else:
        launch_ok = _num_eq(seen, theta)
        seen = f"--rotary-base {seen}"
    ok = launch_ok and (ctx.manifest is None or _num_eq(ctx.manifest.rope_theta, theta))
    extra = f", run.json rope_theta {_fmt(ctx.manifest.rope_theta)}" if ctx.manifest is not None else ""
    return _row("model.rotary_base", ok, f"{seen}{extra}", f"{_fmt(theta)} (rope_theta, {src})",
                f"remove model.rotary_base from the recipe and any --rotary-base from launch.extra_args (the launch "
                f"then uses the HF rope_theta {_fmt(theta)}); a run published with another value needs a fresh DRL_RUN")


def check_vocab_tokenizer(ctx: Context) -> Row:
    """Vocabulary size and the tokenizer / chat-template digests agree with run.json and the command."""
    cfg, src = hf_config(ctx)
    if cfg is None:
        return Row(check="model.vocab_tokenizer", status="WARN", seen=src, required="HF vocab and digests")
    vocab = int(cfg["vocab_size"])
    problems = []
    if ctx.flag("--vocab-size") is not None and not _num_eq(ctx.flag("--vocab-size"), vocab):
        problems.append(f"--vocab-size {ctx.flag('--vocab-size')} vs HF {vocab}")
    if ctx.hf_dir is not None and (ctx.hf_dir / "tokenizer.json").is_file() and ctx.manifest is not None:
        from trainer.models.identity import IdentityMismatch, check_model_identity, identity_from_hf

        try:
            check_model_identity(identity_from_hf(ctx.hf_dir), manifest={
                "vocab_size": ctx.manifest.vocab_size, "tokenizer_digest": ctx.manifest.tokenizer_digest,
                "chat_template_digest": ctx.manifest.chat_template_digest})
        except IdentityMismatch as e:
            problems += [ln.strip(" -") for ln in str(e).splitlines()[1:] if ln.startswith("  -")]
    elif ctx.manifest is not None and ctx.manifest.vocab_size != vocab:
        problems.append(f"run.json vocab_size {ctx.manifest.vocab_size} vs HF {vocab}")
    digests = "digests compared with run.json" if ctx.manifest is not None and ctx.hf_dir else "digests recorded at publish"
    seen = "; ".join(problems) if problems else f"vocab {vocab}, {digests}"
    return _row("model.vocab_tokenizer", not problems, seen, f"vocab {vocab} and run.json's digests ({src})",
                "use the same HF checkpoint (config.json, tokenizer.json, chat template) the run was published "
                "with, or start a fresh DRL_RUN for a different model")
