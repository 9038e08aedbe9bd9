"""The join card: values from run.json and the environment, redaction, formats, a private --out file,
and the `invoke joincard` task run as a real process."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_manifest import make_manifest

from worker_contract import signing
from worker_contract.joincard import JoinCardError, build_card, joincard, render, write_card
from worker_contract.manifest import ContractMismatch, create_or_resume
from worker_contract.store.s3 import S3Store

REPO = Path(__file__).resolve().parent.parent
R2 = {"R2_ACCOUNT_ID": "0123456789abcdef0123456789abcdef", "R2_ACCESS_KEY_ID": "AKIDjoincard0000001",
      "R2_SECRET_ACCESS_KEY": "joincard-secret-0123456789abcdef"}


@pytest.fixture
def published(file_store):
    m = make_manifest("card-run", plane="int8g64", kv_mode="paged_prefix", n_samples=8)
    create_or_resume(file_store, m, resume=False)
    return file_store, m


def test_card_from_run_json(published):
    store, m = published
    card = build_card(store, "card-run", {"DRL_RETRIEVER_URL": "http://10.0.0.5:8765"})
    got = {k: v for k, v, _ in card.entries()}
    assert got == {"DRL_STORE": store.url, "DRL_RUN": "card-run", "DRL_N_SAMPLES": "8",
                   "DRL_PULSE_PLANE": "int8g64", "DRL_KV_MODE": "paged_prefix",
                   "DRL_TRAINER_KEY_FINGERPRINT": signing.fingerprint(m.trainer_public_key),
                   "DRL_RETRIEVER_URL": "http://10.0.0.5:8765"}
    assert got["DRL_TRAINER_KEY_FINGERPRINT"].startswith("SHA256:")


def test_a_psqa_card_says_how_each_tier_joins(file_store):
    create_or_resume(file_store, make_manifest("psqa-card", task="psqa", plane="int8g64", kv_mode="paged_prefix"),
                     resume=False)
    text = render(build_card(file_store, "psqa-card", {"DRL_RETRIEVER_URL": "http://10.0.0.5:8765"}))
    assert "http://10.0.0.5:8765" in text
    assert "python -m worker_contract.worker --backend mlx" in text and "light tier (15-23 GB)" in text
    bare = render(build_card(file_store, "psqa-card", {}))
    assert "(not set; the fleet task needs one" in bare
    create_or_resume(file_store, make_manifest("gsm8k-card"), resume=False)
    plain = render(build_card(file_store, "gsm8k-card", {}))
    assert "RETRIEVER" not in plain and "tier" not in plain


def test_r2_card_redacts_unless_revealed(moto_server, s3_bucket):
    store = S3Store(s3_bucket, scheme="r2", endpoint=moto_server.endpoint, access_key=R2["R2_ACCESS_KEY_ID"],
                    secret_key=R2["R2_SECRET_ACCESS_KEY"])
    create_or_resume(store, make_manifest("r2-run"), resume=False)
    card = build_card(store, "r2-run", R2, retriever_url="https://retriever.example:8765")
    names = [k for k, _, _ in card.entries()]
    assert names[:4] == ["R2_ACCOUNT_ID", "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY", "R2_BUCKET"]
    assert "DRL_STORE" not in names and "DRL_KV_MODE" not in names  # r2 is the default; no kv mode set
    for fmt in ("text", "env", "json"):
        hidden, shown = render(card, fmt), render(card, fmt, reveal=True)
        for secret in (R2["R2_ACCESS_KEY_ID"], R2["R2_SECRET_ACCESS_KEY"]):
            assert secret not in hidden and secret in shown
        assert R2["R2_ACCOUNT_ID"] in hidden and s3_bucket in hidden and "r2-run" in hidden
    data = json.loads(render(card, "json", reveal=True))
    assert data["R2_BUCKET"] == s3_bucket and data["R2_SECRET_ACCESS_KEY"] == R2["R2_SECRET_ACCESS_KEY"]
    assert "--reveal" in render(card, "text") and "--reveal" not in render(card, "text", reveal=True)


def test_env_format_sources_in_a_shell(published, tmp_path):
    store, m = published
    card = build_card(store, "card-run", {"R2_ACCESS_KEY_ID": "k$(touch pwned)`x`", "R2_SECRET_ACCESS_KEY": "s'q"})
    path = write_card(render(card, "env", reveal=True), tmp_path / "card.env")
    out = subprocess.run(["bash", "-c", f"set -a; . {path}; env"], capture_output=True, text=True,
                         cwd=tmp_path, check=True).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert env["DRL_RUN"] == "card-run" and env["DRL_PULSE_PLANE"] == "int8g64"
    assert env["DRL_TRAINER_KEY_FINGERPRINT"] == signing.fingerprint(m.trainer_public_key)
    assert not (tmp_path / "pwned").exists()


def test_out_file_is_0600_whatever_the_umask_or_old_file(tmp_path):
    out = tmp_path / "card.txt"
    out.write_text("old")
    os.chmod(out, 0o644)
    old = os.umask(0)
    try:
        write_card("NEW CARD", out)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600 and out.read_text() == "NEW CARD\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["card.txt"]


def test_missing_run_json_is_refused_clearly(file_store):
    with pytest.raises(JoinCardError, match="run 'ghost' has no run.json in file://.*start its trainer first"):
        build_card(file_store, "ghost", {})


def test_environment_contradicting_run_json_is_refused(published):
    store, _ = published
    with pytest.raises(ContractMismatch, match="n_samples: run.json=8 environment=4"):
        build_card(store, "card-run", {"DRL_N_SAMPLES": "4"})
    with pytest.raises(ContractMismatch, match="plane: run.json='int8g64' environment='bf16'"):
        build_card(store, "card-run", {"DRL_PULSE_PLANE": "bf16"})
    build_card(store, "card-run", {"DRL_N_SAMPLES": "8", "DRL_PULSE_PLANE": "int8g64"})


def test_bad_options(published, tmp_path):
    store, _ = published
    with pytest.raises(JoinCardError, match="--format='yaml'"):
        joincard(tmp_path, run="card-run", store=store.url, fmt="yaml", environ={})
    with pytest.raises(JoinCardError, match="retriever URL"):
        build_card(store, "card-run", {}, retriever_url="10.0.0.5:8765")
    for hostless in ("http://:8765", "http://", "http://host:port"):  # a card no worker could search through
        with pytest.raises(JoinCardError, match="with a host"):
            build_card(store, "card-run", {}, retriever_url=hostless)
    with pytest.raises(ValueError, match="DRL_RUN is not set"):
        joincard(tmp_path, store=store.url, environ={})


def _invoke(*args, env=None):
    return subprocess.run([str(Path(sys.executable).parent / "invoke"), *args], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=120)


def test_invoke_task(published, tmp_path):
    store, m = published
    assert "joincard" in _invoke("--list").stdout
    r = _invoke("joincard", "--run", "card-run", "--store", store.url, "--format", "json",
                "--env-file", "/dev/null/none", env={"DRL_RUN": ""})
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = _invoke("joincard", "--run", "card-run", "--store", store.url, "--format", "json",
                "--retriever-url", "http://127.0.0.1:8765", env={"DRL_STORE": ""})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["DRL_TRAINER_KEY_FINGERPRINT"] == signing.fingerprint(m.trainer_public_key)
    out = tmp_path / "sub" / "card"
    r = _invoke("joincard", "--run", "card-run", "--store", store.url, "--out", str(out))
    assert r.returncode == 0 and "mode 0600" in r.stdout and "card-run" not in r.stdout
    assert stat.S_IMODE(out.stat().st_mode) == 0o600 and "Join card for run card-run" in out.read_text()
    r = _invoke("joincard", "--run", "ghost", "--store", store.url)
    assert r.returncode == 2 and "has no run.json" in r.stderr and "Traceback" not in r.stderr


def test_a_revealed_card_never_lands_in_the_tree(moto_server, s3_bucket, tmp_path):
    """docs/r2-setup.md's `invoke joincard --format env --reveal --out card.env`, run from the checkout: the
    card goes to ~/.stoa/cards/card.env (0600), not into the tree, and an --out path inside the repository
    is refused in one sentence (exit 2) while a redacted card may go there."""
    env = moto_server.env()
    store = S3Store(s3_bucket, endpoint=env["DRL_S3_ENDPOINT"], access_key=env["AWS_ACCESS_KEY_ID"],
                    secret_key=env["AWS_SECRET_ACCESS_KEY"])
    create_or_resume(store, make_manifest("tree-card"), resume=False)
    home = tmp_path / "home"
    home.mkdir()
    env = {**env, "HOME": str(home), "DRL_STORE": ""}
    secret = env["AWS_SECRET_ACCESS_KEY"]
    args = ["joincard", "--run", "tree-card", "--store", f"s3://{s3_bucket}", "--format", "env", "--reveal"]
    r = _invoke(*args, "--out", "card.env", env=env)
    card = home / ".stoa" / "cards" / "card.env"
    assert r.returncode == 0, r.stderr
    assert str(card) in r.stdout and not (REPO / "card.env").exists()
    assert stat.S_IMODE(card.stat().st_mode) == 0o600 and secret in card.read_text()
    assert stat.S_IMODE(card.parent.stat().st_mode) == 0o700
    for inside in ("./card.env", str(REPO / "runs" / "card.env")):
        r = _invoke(*args, "--out", inside, env=env)
        assert r.returncode == 2 and "inside the repository" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and secret not in r.stdout + r.stderr
        assert not (REPO / "card.env").exists() and not (REPO / "runs" / "card.env").exists()
    redacted = tmp_path / "redacted" / "card.env"
    r = _invoke(*args[:-1], "--out", str(redacted), env=env)
    assert r.returncode == 0 and secret not in redacted.read_text()


def test_out_never_replaces_what_is_not_a_card(published, tmp_path):
    """`--out <symlink>` once replaced the link's target; a directory and a file of the user's are refused
    the same way (exit 2, one sentence), each left as it was; a card written before is replaced."""
    store, _ = published
    target = tmp_path / "precious.txt"
    target.write_text("the user's own file\n")
    (tmp_path / "link.env").symlink_to(target)
    (tmp_path / "adir").mkdir()
    for out, says in (("link.env", "symbolic link"), ("precious.txt", "not a join card"), ("adir", "directory")):
        r = _invoke("joincard", "--run", "card-run", "--store", store.url, "--out", str(tmp_path / out),
                    env={"DRL_STORE": ""})
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (out, r.stderr)
    assert target.read_text() == "the user's own file\n" and (tmp_path / "link.env").is_symlink()
    assert list((tmp_path / "adir").iterdir()) == []
    for fmt in ("text", "env", "json", "env"):  # each format's card, then a card over a card of another format
        r = _invoke("joincard", "--run", "card-run", "--store", store.url, "--format", fmt, "--out",
                    str(tmp_path / "card"), env={"DRL_STORE": ""})
        assert r.returncode == 0, r.stderr
