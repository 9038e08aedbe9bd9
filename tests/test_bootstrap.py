"""infra/bootstrap.py: the set-up hands pip's settings to uv, and leaves to pip what uv would get wrong.

Real pip reads the settings (a pip.conf of the test's own beside this machine's, PIP_* variables); real
venvs decide whether the system's packages are seen. Nothing is installed here: `make test` itself runs
the set-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from infra import bootstrap

ROOT = Path(__file__).resolve().parent.parent

PIP_CONF = """\
[global]
index-url = https://__token__:s3cret@mirror.example/simple
extra-index-url =
    file:///opt/a/simple
    file:///opt/b/simple
find-links = /global/wheels
constraint = /etc/caps.txt
cert = /etc/my ca.pem

[install]
find-links = /install/wheels

[download]
find-links = /download/wheels
"""


def _settings(monkeypatch, tmp_path, conf: str | None, **pip_env: str) -> dict | None:
    for k in [k for k in os.environ if k.startswith(("PIP_", "UV_"))]:
        monkeypatch.delenv(k)
    if conf is not None:
        (tmp_path / "pip.conf").write_text(conf)
        monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "pip.conf"))
    else:
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for k, v in pip_env.items():
        monkeypatch.setenv(k, v)
    return bootstrap.pip_settings(sys.executable)


def test_pips_own_reading_of_its_settings_reaches_uv(monkeypatch, tmp_path):
    # a quiet pip (its `config list` would print nothing) and uv's own variables change nothing
    s = _settings(monkeypatch, tmp_path, PIP_CONF, PIP_QUIET="1", UV_EXCLUDE_NEWER="2020-01-01T00:00:00Z")
    assert s["index_url"] == "https://__token__:s3cret@mirror.example/simple"
    assert s["extra_index_urls"] == ["file:///opt/a/simple", "file:///opt/b/simple"]  # a multi-line value
    assert s["find_links"] == ["/install/wheels"]  # [install] over [global]; [download] is not pip install's
    assert s["constraints"] == ["/etc/caps.txt"] and s["cert"] == "/etc/my ca.pem"
    argv, env = bootstrap.uv_install("uv", "/venv/bin/python", s)
    assert argv == ["uv", "pip", "install", "--no-config", "--python", "/venv/bin/python", "--index-strategy",
                    "unsafe-best-match", "--find-links", "/install/wheels", "--constraint", "/etc/caps.txt"]
    assert env["UV_DEFAULT_INDEX"] == s["index_url"] and env["UV_INDEX"] == "file:///opt/a/simple file:///opt/b/simple"
    assert env["SSL_CERT_FILE"] == "/etc/my ca.pem" and "UV_EXCLUDE_NEWER" not in env
    assert "s3cret" not in " ".join(argv)  # the command line is printed; the index's token is not


def test_a_pip_setting_uv_is_not_given_leaves_the_install_to_pip(monkeypatch, tmp_path):
    s = _settings(monkeypatch, tmp_path, None, PIP_TRUSTED_HOST="mirror.example", PIP_FIND_LINKS="/opt/wheels")
    assert s == {"trusted_hosts": ["mirror.example"], "find_links": ["/opt/wheels"]}
    assert bootstrap.why_not_uv(s) == "pip has settings uv is not given (trusted_hosts)"
    assert bootstrap.why_not_uv({"find_links": ["/opt/wheels"], "quiet": 1}) is None
    assert bootstrap.why_not_uv(None) == "this pip could not list its settings"


def _why_in_venv(tmp_path: Path, *flags: str) -> str:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", *flags, str(venv)], check=True)
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from infra import bootstrap; print(bootstrap.why_not_uv({{}}))"
    return subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_venv_that_sees_the_systems_packages_installs_with_pip(tmp_path):
    assert _why_in_venv(tmp_path, "--system-site-packages") == \
        "the venv sees the system's packages, which uv would install over"
    assert _why_in_venv(tmp_path, "--clear") == "None"


def test_outside_a_venv_it_installs_nothing_and_says_why():
    python = getattr(sys, "_base_executable", None) or "python3"
    out = subprocess.run([python, str(ROOT / "infra" / "bootstrap.py")], capture_output=True, text=True)
    assert out.returncode == 1
    assert "run it with the venv's python" in out.stderr
