"""`python -m worker_contract verify` as a real process: it takes its credentials the way every entry point
does (worker_contract.env: an env file, `.r2env` in the current directory or `--env-file`, mode 0600,
with the environment winning over it), and its store and run from DRL_STORE / DRL_RUN when not given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY
from learner_fixtures import manifest

from trainer.publish.publisher import Publisher
from worker_contract.manifest import create_or_resume
from worker_contract.signing import generate_private_key
from worker_contract.store.file import FileStore

REPO = Path(__file__).resolve().parent.parent
RUN = "cli-run"


def publish(store, n: int = 3) -> None:
    key = generate_private_key()
    man = create_or_resume(store, manifest(RUN, key), resume=False)
    pub = Publisher(store, man, key, anchor_interval=2, progress=False)
    state = {"model.w.weight": torch.randn(16, 64, generator=torch.Generator().manual_seed(0))}
    for _ in range(n):
        pub.publish(state)
        state["model.w.weight"][0] += 1


def verify(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI with no credentials in its environment but what `env` adds."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("R2_", "DRL_", "AWS_"))}
    return subprocess.run([sys.executable, "-m", "worker_contract", "verify", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**base, "PYTHONPATH": str(REPO), **(env or {})})


def write_env(path: Path, values: dict[str, str], mode: int = 0o600) -> Path:
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    os.chmod(path, mode)
    return path


@pytest.fixture
def s3_run(s3_store, moto_server, tmp_path):
    """A run published on a fresh bucket of the loopback S3 server; the env file values that reach it."""
    publish(s3_store)
    values = {**moto_server.env(), "DRL_STORE": s3_store.url, "DRL_RUN": RUN}
    return values, tmp_path


def test_reads_dotenv_in_the_current_directory(s3_run):
    values, cwd = s3_run
    write_env(cwd / ".r2env", values)
    res = verify(cwd)  # store, run and credentials all from ./.r2env
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1].endswith("0 failures: OK")
    assert TEST_SECRET_KEY not in res.stdout + res.stderr and TEST_ACCESS_KEY not in res.stdout + res.stderr


def test_env_file_option_and_the_environment_winning_over_the_file(s3_run):
    values, cwd = s3_run
    other = cwd / "elsewhere"
    other.mkdir()
    creds = write_env(other / "creds.env", {**values, "DRL_RUN": "not-this-run"})
    res = verify(cwd, "--env-file", str(creds), env={"DRL_RUN": RUN})
    assert res.returncode == 0, res.stdout + res.stderr
    wrong = verify(cwd, "--env-file", str(creds))  # the file's DRL_RUN names a run that does not exist
    assert wrong.returncode == 2 and "has no run.json" in wrong.stderr and "check --run" in wrong.stderr  # bad input
    missing = verify(cwd, "--env-file", str(other / "nope.env"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_an_env_file_others_can_read_is_refused_with_the_fix(s3_run):
    values, cwd = s3_run
    path = write_env(cwd / ".r2env", values, mode=0o644)
    res = verify(cwd)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "mode 0644" in res.stderr and f"chmod 600 {path}" in res.stderr
    assert TEST_SECRET_KEY not in res.stdout + res.stderr
    os.chmod(path, 0o600)
    assert verify(cwd).returncode == 0


def test_default_store_is_the_embedded_file_store(tmp_path):
    publish(FileStore(tmp_path / ".stoa" / "bucket"), n=2)
    res = verify(tmp_path, "--run", RUN)
    assert res.returncode == 0 and "pointer v2" in res.stdout, res.stdout + res.stderr
    quiet = verify(tmp_path, "--run", RUN, "--quiet")  # a long run has a line per version: only the summary here
    assert quiet.returncode == 0 and quiet.stdout.strip() == res.stdout.strip().splitlines()[-1], quiet.stdout
    res = verify(tmp_path)
    assert res.returncode == 2 and "pass --run RUN or set DRL_RUN" in res.stderr, res.stderr


def test_a_run_whose_run_json_is_gone_fails_the_check_and_a_wrong_id_is_bad_input(tmp_path):
    """A run id the store holds nothing of is a typo (exit 2, one sentence); a run whose run.json was deleted
    from under its versions is a damaged run, which the check reports (exit 1)."""
    store = FileStore(tmp_path / ".stoa" / "bucket")
    publish(store, n=2)
    typo = verify(tmp_path, "--run", RUN + "x")
    assert typo.returncode == 2 and "check --run" in typo.stderr, typo.stdout + typo.stderr
    (store.root / RUN / "run.json").unlink()
    damaged = verify(tmp_path, "--run", RUN)
    assert damaged.returncode == 1 and "FAIL" in damaged.stdout and "has no run.json" in damaged.stdout, damaged.stderr
    quiet = verify(tmp_path, "--run", RUN, "-q")
    assert quiet.returncode == 1 and quiet.stdout == damaged.stdout, quiet.stdout  # its one line is the failure
