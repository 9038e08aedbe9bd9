"""The dry run: prints the fully resolved launch (every contract flag, secrets redacted) and changes nothing,
here or on the box; its plan parses back (the preflight reads it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sshd import sshd_server  # noqa: F401  (fixture)

from infra.launch_gpu import build_plan, launch_on_this_box
from infra.launch_plan import BEGIN_MARKER, END_MARKER, PlanError, parse_plan, render_plan
from infra.remote import launch_remote
from trainer.config import REPO_ROOT, resolve

SECRET = "dryrun-SECRET-7c1f0e9d8b"
#: these tests read the slime engine's launch (the gsm8k recipe's default engine is native:
#: tests/test_native_launch.py)
SLIME = {"train.engine": "slime"}
KEY_ID = "dryrun-KEYID-55aa66bb"
CREDS = {"R2_ACCOUNT_ID": "acct-dry", "R2_ACCESS_KEY_ID": KEY_ID, "R2_SECRET_ACCESS_KEY": SECRET,
         "R2_BUCKET": "stoa-dry"}

#: flag -> value (None: a switch) the quickstart launch must carry (docs/objective.md)
GSM8K_FLAGS = {
    "--rollout-num-gpus": "0",
    "--rollout-function-path": "trainer.slime_plugin.rollout.generate_rollout",
    "--custom-tis-function-path": "trainer.slime_plugin.objective.dppo_gate",
    "--get-mismatch-metrics": None,
    "--custom-pg-loss-reducer-function-path": "trainer.slime_plugin.objective.drgrpo_reducer",
    "--rollout-data-postprocess-path": "trainer.slime_plugin.audit.audit_rollout_data",
    "--custom-reward-post-process-path": "trainer.slime_plugin.objective.drgrpo_rewards",
    "--custom-after-train-hook-path": "trainer.slime_plugin.publish.after_train",
    "--advantage-estimator": "grpo",
    "--disable-grpo-std-normalization": None,
    "--eps-clip": "0.2",
    "--eps-clip-high": "0.28",
    "--eps-clip-c": "3",
    "--use-kl-loss": None,
    "--kl-loss-coef": "0.001",
    "--kl-loss-type": "low_var_kl",
    "--use-rollout-logprobs": None,
    "--use-dynamic-batch-size": None,
    "--max-tokens-per-gpu": "16384",
    "--rollout-batch-size": "8",
    "--n-samples-per-prompt": "8",
    "--global-batch-size": "64",
    "--rollout-temperature": "1",
    "--rollout-top-p": "1",
    "--rotary-base": "1000000",
    "--save-interval": "4",
    "--lr": "1e-06",
}
PATH_FLAGS = ("--hf-checkpoint", "--ref-load", "--load", "--save")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ("DRL_STORE", "DRL_N_SAMPLES", "DRL_PULSE_PLANE", "DRL_KV_MODE", "DRL_DRY_RUN", *CREDS):
        monkeypatch.delenv(var, raising=False)
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    return tmp_path


def _flag(args: list[str], name: str):
    assert name in args, f"{name} missing from the launch command"
    i = args.index(name)
    return args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None


def _snapshot(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in root.rglob("*")} if root.exists() else {}


def test_quickstart_dry_run_has_every_contract_flag_and_no_secret(clean_env):
    cfg = resolve("gsm8k", env={"DRL_RUN": "dry-gsm8k"}, overrides=SLIME)
    stoa_before = _snapshot(REPO_ROOT / ".stoa")
    lines: list[str] = []
    assert launch_on_this_box(cfg, dry_run=True, out=lines.append) == 0
    text = "\n".join(lines)
    plan = parse_plan(text)
    for name, value in GSM8K_FLAGS.items():
        assert _flag(plan.slime_args, name) == value, name
    for name in PATH_FLAGS:
        assert _flag(plan.slime_args, name).startswith(str(REPO_ROOT))
    assert _flag(plan.slime_args, "--load") == _flag(plan.slime_args, "--save")
    assert "--save-hf" not in plan.slime_args and "--debug-train-only" not in plan.slime_args
    assert plan.command[:3] == ["ray", "job", "submit"] and "train.py" in plan.command[plan.command.index("--") + 2]
    assert "staleness      bound 3 versions, reuse cap 2" in text
    assert "8 groups x 8 samples per step" in text
    assert plan.recipe["algo"]["staleness"] == 3 and plan.recipe["algo"]["reuse_cap"] == 2
    assert plan.env["DRL_PULSE_PLANE"] == "bf16" and plan.env["DRL_N_SAMPLES"] == "8"
    assert plan.env["DRL_STORE"] == "r2://stoa-dry" and plan.env["R2_SECRET_ACCESS_KEY"] == "**********"
    assert SECRET not in text and KEY_ID not in text
    assert _snapshot(REPO_ROOT / ".stoa") == stoa_before  # nothing written locally


def test_remote_dry_run_never_touches_the_box(clean_env, sshd_server):  # noqa: F811
    cfg = resolve("gsm8k", env={"DRL_RUN": "dry-remote"}, overrides=SLIME)
    remote = clean_env / "box" / "dRL"
    lines: list[str] = []
    rc = launch_remote(cfg, host=sshd_server.host, ssh_key=str(sshd_server.client_key), remote_dir=str(remote),
                       dry_run=True, out=lines.append)
    assert rc == 0
    plan = parse_plan("\n".join(lines))
    assert plan.host == sshd_server.host and plan.remote_dir == str(remote)
    assert _flag(plan.slime_args, "--ref-load").startswith(str(remote))
    assert plan.log_file == f"{remote}/logs/dry-remote.log"
    assert [s.name for s in plan.steps][:3] == ["connect", "check_box", "ship_tree"]
    assert not remote.exists()
    assert "Accepted" not in sshd_server.log_text() and "Connection from" not in sshd_server.log_text()


def test_fleet_recipe_reuses_the_generator_with_its_values(clean_env, monkeypatch):
    monkeypatch.setenv("DRL_KV_MODE", "paged_prefix")
    cfg = resolve("psqa", env={"DRL_RUN": "dry-psqa", "DRL_KV_MODE": "paged_prefix"}, overrides=SLIME)
    lines: list[str] = []
    assert launch_on_this_box(cfg, dry_run=True, out=lines.append) == 0
    plan = parse_plan("\n".join(lines))
    args = plan.slime_args
    # the recipe's memory plan, in Megatron's words: bf16 moments, the whole optimizer offloaded
    assert _flag(args, "--exp-avg-sq-dtype") == "bf16" and _flag(args, "--optimizer-offload-fraction") == "1"
    assert (_flag(args, "--save-interval"), _flag(args, "--eps-clip"), _flag(args, "--eps-clip-high"),
            _flag(args, "--eps-clip-c")) == ("4", "10000", "19", "20")
    assert "--save-hf" not in args
    assert _flag(args, "--rollout-max-response-len") == "4096"
    assert plan.env["DRL_PULSE_PLANE"] == "int8g64" and plan.env["DRL_KV_MODE"] == "paged_prefix"


def test_fleet_recipe_defaults_to_the_native_engine(clean_env, monkeypatch):
    """The fleet model fits one H200 on the native engine (docs/performance.md): the default psqa plan runs
    entrypoints.learner with the recipe's memory plan, and no slime flags."""
    monkeypatch.setenv("DRL_KV_MODE", "paged_prefix")
    cfg = resolve("psqa", env={"DRL_RUN": "dry-psqa-native", "DRL_KV_MODE": "paged_prefix"})
    assert cfg.train.engine == "native" and cfg.optim.moment_dtype == "bfloat16"
    assert cfg.optim.offload == 1.0
    lines: list[str] = []
    assert launch_on_this_box(cfg, dry_run=True, out=lines.append) == 0
    plan = parse_plan("\n".join(lines))
    assert plan.slime_args == [] and "-m entrypoints.learner" in " ".join(plan.command)
    assert plan.recipe["optim"]["offload"] == 1.0


def test_make_level_dry_run_output_parses(clean_env, monkeypatch):
    """`DRL_DRY_RUN=1 python -m infra.launch_gpu --recipe-json ...` (the box entry) prints a parsable plan."""
    cfg = resolve("gsm8k", env={"DRL_RUN": "dry-entry"}, overrides=SLIME)
    recipe = clean_env / "recipe.json"
    recipe.write_text(cfg.model_dump_json())
    env = {**os.environ, "DRL_DRY_RUN": "1", "PYTHONPATH": str(REPO_ROOT)}
    res = subprocess.run([sys.executable, "-m", "infra.launch_gpu", "--recipe-json", str(recipe)], env=env,
                         capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert res.returncode == 0, res.stderr
    assert parse_plan("make: entering\n" + res.stdout + "trailing noise\n").run == "dry-entry"
    assert SECRET not in res.stdout + res.stderr


def test_plan_round_trip_and_refusals(clean_env):
    cfg = resolve("gsm8k", env={"DRL_RUN": "dry-rt"}, overrides=SLIME)
    plan = build_plan(cfg, host=None, remote_dir="/root/dRL", env=CREDS, store="r2://stoa-dry")
    text = render_plan(plan)
    assert text.count(BEGIN_MARKER) == 1 and text.count(END_MARKER) == 1
    assert parse_plan(text) == plan
    with pytest.raises(PlanError, match="no launch plan found"):
        parse_plan("nothing here")
    with pytest.raises(PlanError, match="not JSON"):
        parse_plan(f"{BEGIN_MARKER}\n{{oops\n{END_MARKER}\n")
    with pytest.raises(PlanError, match="plan_version"):
        parse_plan(f"{BEGIN_MARKER}\n{{\"plan_version\": 9}}\n{END_MARKER}\n")
    from worker_contract.env import register_secret

    register_secret(SECRET)
    leaked = plan.model_copy(update={"notes": [f"oops {SECRET}"]})
    with pytest.raises(AssertionError, match="secret"):
        render_plan(leaked)


def test_a_rotary_base_other_than_rope_theta_is_refused(clean_env):
    cfg = resolve("gsm8k", env={"DRL_RUN": "dry-rope"}, overrides={"model.rotary_base": 10000})
    with pytest.raises(ValueError, match="rotary base 10000 .recipe model.rotary_base.*rope_theta 1000000"):
        build_plan(cfg, host=None, remote_dir="/root/dRL", env=CREDS, store="r2://stoa-dry").slime_args  # noqa: B018


def test_trainer_only_mode_follows_the_slime_on_the_box(tmp_path, clean_env):
    """slime with PR #2057 gets --rollout-num-gpus 0; an older slime --debug-train-only; a plan made away
    from the box (HOST) keeps the default and says the box re-checks it."""
    from infra.slime_launch import detect_trainer_only

    actor = tmp_path / "slime" / "slime" / "backends" / "megatron_utils" / "actor.py"
    actor.parent.mkdir(parents=True)
    actor.write_text("def update_weights(self):\n    return\n")
    assert detect_trainer_only(str(tmp_path / "slime")) == "debug-train-only"
    assert detect_trainer_only(str(tmp_path / "nowhere")) is None
    cfg = resolve("gsm8k", env={"DRL_RUN": "dry-old"}, overrides={**SLIME, "launch.slime_dir": str(tmp_path / "slime")})
    plan = build_plan(cfg, host=None, remote_dir="/root/dRL", env=CREDS, store="r2://stoa-dry")
    assert "--debug-train-only" in plan.slime_args and "--rollout-num-gpus" not in plan.slime_args
    assert any("predates PR #2057" in n for n in plan.notes)
    actor.write_text('logger.info("No updatable SGLang engines are running; skip weight update.")\n')
    plan = build_plan(cfg, host=None, remote_dir="/root/dRL", env=CREDS, store="r2://stoa-dry")
    assert _flag(plan.slime_args, "--rollout-num-gpus") == "0" and "--debug-train-only" not in plan.slime_args
    remote = build_plan(cfg, host="root@box", remote_dir="/root/dRL", env=CREDS, store="r2://stoa-dry")
    assert any("checked on the box at launch" in n for n in remote.notes)
