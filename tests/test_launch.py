"""`python -m entrypoints.launch` (what `make gsm8k` runs): where a job goes, and a dry run that shows the resolved
configuration and what would run, changes nothing and prints no secret."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from entrypoints.launch import choose_mode

REPO = Path(__file__).resolve().parent.parent
SECRET = "launch-test-secret-value-0123456789"
KEY_ID = "AKIALAUNCHTESTKEY001"
R2 = {"R2_ACCOUNT_ID": "acct0123", "R2_ACCESS_KEY_ID": KEY_ID, "R2_SECRET_ACCESS_KEY": SECRET, "R2_BUCKET": "bkt"}


@pytest.mark.parametrize("host,env,gpu,mode", [
    ("root@box", {}, False, "remote"),            # HOST wins over everything
    ("root@box", R2, True, "remote"),
    (None, R2, True, "gpu"),                      # a GPU and credentials: the real trainer here
    (None, {"DRL_STORE": "s3://b"}, True, "gpu"),
    (None, {}, True, "embedded"),                 # a GPU alone is not enough to publish anywhere shared
    (None, R2, False, "embedded"),                # credentials without a GPU: the embedded default
    (None, {**R2, "R2_SECRET_ACCESS_KEY": ""}, True, "embedded"),  # three of four values are not credentials
    (None, {}, False, "embedded"),
])
def test_choose_mode(host, env, gpu, mode):
    got, why = choose_mode(host=host, env=env, gpu=gpu)
    assert got == mode, why
    assert SECRET not in why


def _launch(*args, env=None, cwd=REPO):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("DRL_", "R2_"))}
    full.update({"PYTHONPATH": str(REPO), "DRL_NO_GPU": "1", **(env or {})})
    return subprocess.run([sys.executable, "-m", "entrypoints.launch", *args], env=full, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _config_of(stdout: str) -> dict:
    """The YAML block the dry run prints between its header and '# environment:'."""
    body = stdout.split("# resolved configuration:\n", 1)[1].split("# environment:", 1)[0]
    return yaml.safe_load(body)


def test_embedded_dry_run_prints_the_resolved_config_and_the_plan_and_no_secret():
    run = "launch-dry-1"
    p = _launch("--recipe", "gsm8k", "--run", run, env={"DRL_DRY_RUN": "1", **R2})
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "# mode: embedded" in out and "no CUDA GPU" in out
    cfg = _config_of(out)
    # the recipe resolved with the embedded overrides applied (the tiny model's own values)
    emb = cfg["embedded"]["overrides"]
    assert cfg["run"] == run and cfg["task"] == emb["task"] == "arithmetic"
    assert cfg["optim"]["lr"] == emb["optim.lr"] and cfg["algo"]["max_new_tokens"] == emb["algo.max_new_tokens"]
    assert cfg["contract"] == {"n_samples": 8, "plane": "bf16", "kv_mode": None}
    assert cfg["algo"]["groups_per_step"] == 8 and cfg["algo"]["staleness"] == 3 and cfg["algo"]["reuse_cap"] == 2
    assert cfg["algo"]["kl_coef"] == 0.001
    # what will run
    assert "python -m worker_contract.worker --store file://" in out and "--worker-id local-2" in out
    assert "python -m entrypoints.learner --recipe-json" in out
    # secrets are redacted, non-secrets shown
    assert SECRET not in out + p.stderr and KEY_ID not in out + p.stderr
    assert "R2_SECRET_ACCESS_KEY=**********" in out and "R2_BUCKET=bkt" in out
    # and nothing was created
    assert not (REPO / ".stoa" / "runs" / run).exists()


def test_environment_and_command_line_win_over_the_embedded_overrides():
    p = _launch("--recipe", "gsm8k", "--run", "launch-dry-2", env={"DRL_DRY_RUN": "1", "DRL_N_SAMPLES": "4"})
    assert p.returncode == 0, p.stderr
    assert _config_of(p.stdout)["contract"]["n_samples"] == 4
    assert "DRL_N_SAMPLES=4" in p.stdout


def test_model_option_uses_the_model_overrides(tmp_path):
    # a config.json the run accepts (the dry run refuses one the run would refuse)
    (tmp_path / "config.json").write_text((REPO / "embedded" / "base_gsm8k" / "config.json").read_text())
    p = _launch("--recipe", "gsm8k", "--run", "launch-dry-3", "--model", str(tmp_path), env={"DRL_DRY_RUN": "1"})
    assert p.returncode == 0, p.stderr
    cfg = _config_of(p.stdout)
    assert cfg["model"]["path"] == str(tmp_path)
    mo = cfg["embedded"]["model_overrides"]
    assert cfg["algo"]["max_new_tokens"] == mo["algo.max_new_tokens"] != cfg["embedded"]["overrides"]["algo.max_new_tokens"]
    assert f"use the model at {tmp_path} (MODEL=)" in p.stdout


def test_psqa_without_host_dry_runs_the_embedded_miniature():
    """`make psqa RUN=x` with no HOST, GPU or R2: the fleet recipe's contract and objective, sizes scaled down,
    the retriever on loopback, one torch and one MLX worker with the psqa environment, the native learner."""
    run = "launch-dry-psqa"
    p = _launch("--recipe", "psqa", "--run", run, env={"DRL_DRY_RUN": "1", "DRL_KV_MODE": "paged_prefix"})
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "# environment:\nDRL_KV_MODE=paged_prefix\n" in out  # the contract variables set, the KV mode among them
    assert "# mode: embedded" in out and "the PaperSearchQA miniature" in out
    cfg = _config_of(out)
    assert cfg["task"] == "psqa" and cfg["contract"] == {"n_samples": 8, "plane": "int8g64", "kv_mode": "paged_prefix"}
    algo = cfg["algo"]
    assert (algo["eps_clip"], algo["eps_clip_high"], algo["eps_clip_c"]) == (10000, 19, 20)
    assert algo["gate"] == {"divergence": "tv", "delta_low": 0.2, "delta_high": 0.2}
    assert (algo["staleness"], algo["reuse_cap"], algo["kl_coef"]) == (3, 2, 0.001)
    emb = cfg["embedded"]["overrides"]
    assert algo["groups_per_step"] == emb["algo.groups_per_step"] < 8
    assert algo["max_new_tokens"] == emb["algo.max_new_tokens"] < 4096 and cfg["optim"]["lr"] == emb["optim.lr"]
    assert cfg["train"]["engine"] == "native" and cfg["train"]["backend"] == "hf"
    assert "python -m infra.retriever serve --corpus" in out and "--host 127.0.0.1" in out
    assert "--backend torch" in out and "--backend mlx" in out and "--worker-id local-2" in out
    assert "--retriever-url <retriever URL> --retriever-tier medium --max-turns 2" in out
    assert "DRL_KV_MODE=paged_prefix DRL_RETRIEVER_URL=<retriever URL>" in out and "DRL_PULSE_PLANE=int8g64" in out
    assert "embedded.psqa_base.ensure_psqa_base" in out and "cover-EM pass@1" in out
    assert "python -m entrypoints.learner --recipe-json" in out
    assert not (REPO / ".stoa" / "runs" / run).exists()
    # WORKER= puts every local worker on one backend
    p = _launch("--recipe", "psqa", "--run", run, "--worker", "torch", env={"DRL_DRY_RUN": "1"})
    assert p.returncode == 0, p.stderr
    assert "2 torch workers" in p.stdout and "--backend mlx" not in p.stdout


def test_remote_dry_run_shows_the_plan_and_no_secret():
    p = _launch("--recipe", "gsm8k", "--run", "launch-dry-4", "--host", "root@127.0.0.1",
                env={"DRL_DRY_RUN": "1", **R2})
    assert p.returncode == 0, p.stderr
    assert "# mode: remote" in p.stdout
    cfg = _config_of(p.stdout)
    assert cfg["model"]["hf_id"] == "Qwen/Qwen2.5-1.5B-Instruct" and cfg["train"]["backend"] == "megatron"
    assert "embedded" not in p.stdout.split("# resolved configuration:")[0]
    assert SECRET not in p.stdout + p.stderr and KEY_ID not in p.stdout + p.stderr


@pytest.mark.parametrize("args,needle", [
    (["--recipe", "gsm9k", "--run", "x1"], "unknown recipe 'gsm9k'; known recipes: gsm8k, psqa"),
    (["--recipe", "gsm8k", "--run", "Bad Run"], "DRL_RUN='Bad Run' is not a valid run id"),
    (["--recipe", "gsm8k", "--run", "m1", "--model", "/nonexistent/model"], "is not an HF model directory"),
])
def test_bad_input_exits_2_with_a_clear_message(args, needle):
    p = _launch(*args, env={"DRL_DRY_RUN": "1"})
    assert p.returncode == 2
    assert needle in p.stderr


def test_help_is_instant_and_lists_the_flags():
    p = _launch("--help")
    assert p.returncode == 0
    for flag in ("--recipe", "--run", "--host", "--model", "--ssh-key", "--remote-dir"):
        assert flag in p.stdout
    probe = subprocess.run([sys.executable, "-c", "import sys, entrypoints.launch; print('torch' in sys.modules)"],
                           cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert probe.stdout.strip() == "False"


#: runs the launch as `python -m entrypoints.launch` does and says, at exit, whether torch was imported
_WATCH_IMPORTS = ("import atexit, runpy, sys\n"
                  "atexit.register(lambda: print('TORCH_IMPORTED', 'torch' in sys.modules, file=sys.stderr))\n"
                  "sys.argv = ['launch', *sys.argv[1:]]\n"
                  "runpy.run_module('entrypoints.launch', run_name='__main__', alter_sys=True)\n")


@pytest.mark.parametrize("args", [("--recipe", "gsm8k"), ("--recipe", "psqa"),
                                  ("--recipe", "gsm8k", "--host", "root@203.0.113.7")])
def test_a_dry_run_does_not_import_torch_on_a_machine_without_a_gpu_driver(args):
    """Importing torch costs about 3 s of CPU, and neither the dry run nor the choice of mode needs it where
    the machine has no GPU driver (DRL_NO_GPU is not set here: the launch finds that out itself)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("DRL_", "R2_"))}
    full.update(PYTHONPATH=str(REPO), DRL_DRY_RUN="1", **R2)  # with credentials: the gpu mode is possible
    p = subprocess.run([sys.executable, "-c", _WATCH_IMPORTS, *args, "--run", "dry-imports"], env=full, cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    driver = any(os.path.exists(path) for path in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd"))
    assert f"TORCH_IMPORTED {driver}" in p.stderr, p.stderr[-2000:]
