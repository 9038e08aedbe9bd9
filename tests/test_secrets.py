"""No secret value appears in logs (DEBUG, third-party included), reprs, error messages, tracebacks or join
card output without --reveal. The credentials travel the real path: a 0600 env file, the env contract,
an S3 store talking HTTP to moto (through the fault proxy), the join card and the `invoke joincard` task."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from test_manifest import make_manifest

from worker_contract.env import REDACTED, EnvError, load_env, parse_env, read_env_file
from worker_contract.joincard import build_card, render
from worker_contract.manifest import create_or_resume
from worker_contract.store import open_store
from worker_contract.store.s3 import S3Store

ACCESS = "AKIASECRETSTEST00001"
SECRET = "sekrit/Value+that-must-never-print-9f8e7d6c5b4a"
REPO = Path(__file__).resolve().parent.parent


def _env_file(tmp_path, moto_server, bucket, endpoint) -> Path:
    path = tmp_path / "creds.env"
    path.write_text(f"R2_ACCOUNT_ID=0123456789abcdef0123456789abcdef\nR2_ACCESS_KEY_ID={ACCESS}\n"
                    f"R2_SECRET_ACCESS_KEY={SECRET}\nR2_BUCKET={bucket}\nDRL_STORE=s3://{bucket}\n"
                    f"DRL_S3_ENDPOINT={endpoint}\nDRL_RUN=secret-run\n")
    os.chmod(path, 0o600)
    return path


def _errtext(e: BaseException) -> str:
    return "".join(traceback.format_exception(e)) + repr(e) + str(e)


def test_no_secret_anywhere(tmp_path, moto_server, s3_bucket, fault_proxy, caplog, capsys):
    caplog.set_level(logging.DEBUG)  # everything, botocore's wire log included
    texts: list[str] = []
    env_file = _env_file(tmp_path, moto_server, s3_bucket, fault_proxy.url)
    env = load_env({}, env_file=env_file)
    contract = parse_env(env)
    texts += [repr(contract), str(contract), contract.model_dump_json(), repr(contract.model_dump())]

    store = open_store(env["DRL_STORE"], env)
    texts += [repr(store), str(store), store.url, repr(vars(store))]
    create_or_resume(store, make_manifest("secret-run"), resume=False)
    store.put("secret-run/x", b"1")
    logging.getLogger("careless.caller").warning("creds are %s / %s", ACCESS, SECRET)  # the safety net

    failures = [lambda: store.get("secret-run/missing"),
                lambda: store.put_if_absent("secret-run/x", b"2"),
                lambda: create_or_resume(store, make_manifest("secret-run"), resume=True)]
    for call in failures:
        with pytest.raises(Exception) as err:
            call()
        texts.append(_errtext(err.value))
    fault_proxy.rate, fault_proxy.kinds = 1.0, ("503",)
    flaky = S3Store.from_url(env["DRL_STORE"], env, max_attempts=2)
    with pytest.raises(Exception) as err:
        flaky.get("secret-run/x")
    texts.append(_errtext(err.value))
    fault_proxy.rate = 0.0
    dead = S3Store.from_url(env["DRL_STORE"], {**env, "DRL_S3_ENDPOINT": "http://127.0.0.1:9"},
                            max_attempts=2, connect_timeout=0.5)
    with pytest.raises(Exception) as err:
        dead.put("k", b"v")
    texts.append(_errtext(err.value))

    readable = tmp_path / "readable.env"
    readable.write_text(env_file.read_text() + "junk line with " + SECRET + "\n")
    for mode in (0o644, 0o600):
        os.chmod(readable, mode)
        with pytest.raises(EnvError) as err:
            read_env_file(readable)
        texts.append(_errtext(err.value))

    card = build_card(store, "secret-run", env)
    texts += [repr(card), str(card), card.model_dump_json()] + [render(card, f) for f in ("text", "env", "json")]
    assert SECRET in render(card, "json", reveal=True)  # positive control: the check below can fail

    task = subprocess.run(
        [str(Path(sys.executable).parent / "invoke"), "joincard", "--env-file", str(env_file)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith(("R2_", "DRL_", "AWS_"))})
    assert task.returncode == 0, task.stderr
    texts += [task.stdout, task.stderr]

    captured = capsys.readouterr()
    texts += [captured.out, captured.err, caplog.text]
    assert "Credential=" + REDACTED in caplog.text  # botocore's wire log was captured, and redacted
    assert REDACTED + " / " + REDACTED in caplog.text
    for text in texts:
        assert ACCESS not in text and SECRET not in text, text[:2000]
