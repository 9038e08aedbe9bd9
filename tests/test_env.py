"""The env contract: parsing, clear refusals, the private credentials file, the store default."""

from __future__ import annotations

import os

import pytest

from worker_contract import env as envmod
from worker_contract.env import EnvError, default_store_url, load_env, parse_env, read_env_file

R2 = {"R2_ACCOUNT_ID": "0123456789abcdef0123456789abcdef", "R2_ACCESS_KEY_ID": "AKIDtest00000000",
      "R2_SECRET_ACCESS_KEY": "secret-value-for-env-tests-000", "R2_BUCKET": "drl-bucket"}


def _write(path, text, mode=0o600):
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_defaults():
    c = parse_env({})
    assert (c.run, c.n_samples, c.plane, c.kv_mode, c.store, c.dry_run) == (None, 8, None, None, None, False)
    assert not c.has_r2


def test_full_contract():
    c = parse_env({"DRL_RUN": "gsm8k-a", "DRL_N_SAMPLES": " 16 ", "DRL_PULSE_PLANE": "int8g64",
                   "DRL_KV_MODE": "paged_prefix", "DRL_STORE": "s3://bkt", "DRL_DRY_RUN": "1", **R2})
    assert (c.run, c.n_samples, c.plane, c.kv_mode, c.store, c.dry_run) == \
        ("gsm8k-a", 16, "int8g64", "paged_prefix", "s3://bkt", True)
    assert c.has_r2 and c.r2_bucket == "drl-bucket"
    assert c.r2_secret_access_key.get_secret_value() == R2["R2_SECRET_ACCESS_KEY"]
    assert c.require_run() == "gsm8k-a"


def test_empty_values_count_as_unset():
    c = parse_env({"DRL_RUN": "", "DRL_N_SAMPLES": "", "DRL_PULSE_PLANE": " ", "DRL_DRY_RUN": ""})
    assert (c.run, c.n_samples, c.plane, c.dry_run) == (None, 8, None, False)
    with pytest.raises(EnvError, match="DRL_RUN is not set"):
        c.require_run()


@pytest.mark.parametrize("var, value, match", [
    ("DRL_RUN", "My Run", r"DRL_RUN='My Run' is not a valid run id"),
    ("DRL_RUN", "x" * 64, "1-63 characters"),
    ("DRL_N_SAMPLES", "eight", r"DRL_N_SAMPLES='eight' must be an integer >= 1"),
    ("DRL_N_SAMPLES", "0", r"DRL_N_SAMPLES='0' must be an integer >= 1"),
    ("DRL_N_SAMPLES", "2.5", "must be an integer"),
    ("DRL_PULSE_PLANE", "fp8", r"DRL_PULSE_PLANE='fp8' must be one of: bf16, int8g64"),
    ("DRL_KV_MODE", "paged prefix;", "DRL_KV_MODE="),
    ("DRL_STORE", "/tmp/bucket", r"DRL_STORE='/tmp/bucket' must be file:///abs/path, r2://<bucket> or s3://"),
    ("DRL_STORE", "gs://x", "DRL_STORE="),
    ("DRL_DRY_RUN", "maybe", r"DRL_DRY_RUN='maybe' must be 1 or 0"),
])
def test_bad_values_name_variable_value_and_fix(var, value, match):
    with pytest.raises(ValueError, match=match):
        parse_env({var: value})


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("YES", True), ("0", False),
                                             ("off", False)])
def test_dry_run_values(value, expected):
    assert parse_env({"DRL_DRY_RUN": value}).dry_run is expected


def test_env_file_is_read(tmp_path):
    f = _write(tmp_path / ".r2env", "# R2 credentials\n\nexport R2_ACCOUNT_ID=0123456789abcdef0123456789abcdef\n"
               "R2_ACCESS_KEY_ID='AKIDtest00000000'\nR2_SECRET_ACCESS_KEY=\"a=b secret\"\n R2_BUCKET = drl-bucket \n")
    assert read_env_file(f) == {**R2, "R2_SECRET_ACCESS_KEY": "a=b secret"}


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o660])
def test_readable_env_file_is_refused_with_the_chmod_fix(tmp_path, mode):
    f = _write(tmp_path / ".r2env", "R2_BUCKET=b\n", mode)
    with pytest.raises(EnvError) as err:
        read_env_file(f)
    assert f"chmod 600 {f}" in str(err.value) and f"{mode:04o}" in str(err.value)
    with pytest.raises(EnvError, match="chmod 600"):
        load_env({}, repo_root=tmp_path)  # the default .r2env is checked the same way


def test_malformed_line_is_refused_without_echoing_it(tmp_path):
    f = _write(tmp_path / "creds", "R2_BUCKET=b\nthis-is-a-secret-looking-line\n")
    with pytest.raises(EnvError) as err:
        read_env_file(f)
    assert f"{f}:2" in str(err.value) and "secret-looking" not in str(err.value)


def test_environment_wins_over_the_file(tmp_path):
    _write(tmp_path / ".r2env", "R2_BUCKET=from-file\nR2_ACCOUNT_ID=acct\nDRL_N_SAMPLES=4\n")
    merged = load_env({"R2_BUCKET": "from-env", "R2_ACCOUNT_ID": "", "PATH": "/bin"}, repo_root=tmp_path)
    assert merged["R2_BUCKET"] == "from-env"
    assert merged["R2_ACCOUNT_ID"] == "acct"  # an empty environment value does not hide the file's
    assert merged["DRL_N_SAMPLES"] == "4" and merged["PATH"] == "/bin"


def test_env_file_paths(tmp_path):
    assert load_env({"A": "1"}, repo_root=tmp_path) == {"A": "1"}  # no default file: fine
    with pytest.raises(EnvError, match="does not exist"):
        load_env({}, env_file=tmp_path / "missing.env")
    other = _write(tmp_path / "other.env", "R2_BUCKET=x\n")
    assert load_env({}, env_file=other, repo_root=tmp_path) == {"R2_BUCKET": "x"}


def test_default_store_url(tmp_path):
    assert default_store_url({}, tmp_path) == f"file://{tmp_path.resolve()}/.stoa/bucket"
    assert default_store_url(R2, tmp_path) == "r2://drl-bucket"
    partial = {k: v for k, v in R2.items() if k != "R2_SECRET_ACCESS_KEY"}
    with pytest.raises(EnvError, match="R2_SECRET_ACCESS_KEY is empty"):  # never the file store in silence
        default_store_url(partial, tmp_path)
    assert default_store_url({**R2, "DRL_STORE": "s3://other"}, tmp_path) == "s3://other"
    with pytest.raises(EnvError):
        default_store_url({"DRL_STORE": "nope"}, tmp_path)


def test_secrets_repr_as_asterisks():
    c = parse_env(R2)
    for text in (repr(c), str(c), c.model_dump_json(), repr(c.model_dump())):
        assert R2["R2_SECRET_ACCESS_KEY"] not in text and R2["R2_ACCESS_KEY_ID"] not in text
    assert envmod.redact(f"x {R2['R2_SECRET_ACCESS_KEY']} y") == f"x {envmod.REDACTED} y"


def test_a_comment_after_a_value_is_no_part_of_it(tmp_path):
    """`R2_SECRET_ACCESS_KEY=abc  # mine` once made 'abc  # mine' the secret."""
    f = _write(tmp_path / ".r2env", "R2_SECRET_ACCESS_KEY=abcdef0123  # the key from the dashboard\n"
                                    "R2_BUCKET='has # inside'\nR2_ACCESS_KEY_ID=a#b\n")
    assert read_env_file(f) == {"R2_SECRET_ACCESS_KEY": "abcdef0123", "R2_BUCKET": "has # inside",
                                "R2_ACCESS_KEY_ID": "a#b"}


@pytest.mark.timeout(30)
def test_a_fifo_r2env_is_refused_not_waited_on(tmp_path):
    """A FIFO .r2env (no writer) once hung `invoke status` forever."""
    os.mkfifo(tmp_path / ".r2env", 0o600)
    with pytest.raises(EnvError, match="not a regular file"):
        load_env({}, repo_root=tmp_path)


def test_credentials_in_an_endpoint_are_redacted_whole():
    """DRL_S3_ENDPOINT=http://<access key>:<secret with @>@host once showed the user name and half the secret."""
    url = "http://AKIDINURL0001:pa@ss-w0rd-tail@127.0.0.1:9000"
    envmod._register_url_password(url)
    shown = envmod.redact(f"cannot reach {url}/bucket")
    assert "AKIDINURL0001" not in shown and "pa@ss" not in shown and "w0rd-tail" not in shown, shown
    assert shown.endswith("@127.0.0.1:9000/bucket")


@pytest.mark.parametrize("url", ["s3://bucket/with/path", "r2://Bucket_Name", "s3://bucket:9000", "r2://ab",
                                 "file:///tmp/x ", " r2://my-bucket", "s3://user:pw@bucket"])
def test_store_urls_are_refused_alike_by_every_command(url):
    """The dry run (DRL_STORE through parse_env) and status / joincard (--store through check_store_url) once
    disagreed: one accepted what the other refused."""
    with pytest.raises(EnvError):
        envmod.check_store_url(url, "--store")
    with pytest.raises(EnvError):
        parse_env({"DRL_STORE": url}) if url == url.strip() else envmod.check_store_url(url)
