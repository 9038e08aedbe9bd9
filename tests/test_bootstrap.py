"""infra/bootstrap.py: the set-up hands pip's settings to uv, and leaves to pip what uv would get wrong.

Real pip reads the settings (`pip config list` over PIP_* variables, no config file); real venvs decide
whether the system's packages are seen. Nothing is installed here: `make test` itself runs the set-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from infra import bootstrap

ROOT = Path(__file__).resolve().parent.parent


def _settings(monkeypatch, **pip_env: str) -> dict[str, list[str]]:
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # this machine's pip.conf does not count here
    for k in [k for k in os.environ if k.startswith("PIP_") and k != "PIP_CONFIG_FILE"]:
        monkeypatch.delenv(k)
    for k, v in pip_env.items():
        monkeypatch.setenv(k, v)
    return bootstrap.pip_settings(sys.executable)


def test_pips_indexes_links_constraints_and_ca_reach_uv(monkeypatch):
    s = _settings(monkeypatch, PIP_INDEX_URL="https://mirror.example/simple",
                  PIP_EXTRA_INDEX_URL="file:///opt/a/simple file:///opt/b/simple", PIP_FIND_LINKS="/opt/wheels",
                  PIP_CONSTRAINT="/etc/caps.txt", PIP_CERT="/etc/ca.pem", PIP_DEFAULT_TIMEOUT="180")
    assert bootstrap.why_not_uv(s) is None
    argv, env = bootstrap.uv_install("uv", "/venv/bin/python", s)
    assert argv[:4] == ["uv", "pip", "install", "--python"]
    flags = list(zip(argv[7::2], argv[8::2], strict=True))
    assert flags == [("--index-url", "https://mirror.example/simple"), ("--extra-index-url", "file:///opt/a/simple"),
                     ("--extra-index-url", "file:///opt/b/simple"), ("--find-links", "/opt/wheels"),
                     ("--constraint", "/etc/caps.txt")]
    assert env["SSL_CERT_FILE"] == "/etc/ca.pem"


def test_a_pip_setting_uv_is_not_given_leaves_the_install_to_pip(monkeypatch):
    s = _settings(monkeypatch, PIP_TRUSTED_HOST="mirror.example", PIP_FIND_LINKS="/opt/wheels")
    assert bootstrap.why_not_uv(s) == "pip has settings uv is not given (trusted-host)"


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
    python = sys._base_executable if hasattr(sys, "_base_executable") else "python3"
    out = subprocess.run([python, str(ROOT / "infra" / "bootstrap.py")], capture_output=True, text=True)
    assert out.returncode == 1
    assert "run it with the venv's python" in out.stderr
