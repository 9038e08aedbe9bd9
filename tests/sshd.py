"""A real OpenSSH server on 127.0.0.1 for the Fabric tests: own port, own host key, own config, key-only.

Started by the test that asks for it, ended by its PID. Nothing is shared with the system's sshd: the host
key, the client key, authorized_keys, the config and the log all live in the test's tmp folder. sshd needs
its privilege-separation directory (/run/sshd) when run as root; it is created if missing and removed
again only if we created it. Without an sshd binary the tests skip with a message (`make test` installs
openssh-server through `nox -s tests`).

Use: `from sshd import sshd_server  # noqa: F401` in a test module, then a `sshd_server` argument.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

SSHD_CANDIDATES = ("sshd", "/usr/sbin/sshd", "/usr/local/sbin/sshd")
PRIVSEP = "/run/sshd"  # sshd's privilege-separation directory


def find_sshd() -> str | None:
    for c in SSHD_CANDIDATES:
        path = shutil.which(c) or (c if os.path.isabs(c) and os.access(c, os.X_OK) else None)
        if path:
            return path
    return None


def _write_key(path: Path) -> str:
    """Write an ed25519 private key in OpenSSH format (mode 0600); return the public key line."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return pub.decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SshdServer:
    host: str  # user@127.0.0.1:port, the form our tools take
    user: str
    port: int
    client_key: Path
    log: Path
    proc: subprocess.Popen

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_sshd(workdir: Path) -> tuple[SshdServer, bool]:
    """Start sshd in `workdir`; returns the server and whether we created /run/sshd."""
    binary = find_sshd()
    if binary is None:
        pytest.skip("sshd is not installed (apt-get install openssh-server; `make test` does it when root)")
    workdir.mkdir(parents=True, exist_ok=True)
    host_key, client_key = workdir / "host_ed25519", workdir / "client_ed25519"
    _write_key(host_key)
    (workdir / "authorized_keys").write_text(_write_key(client_key) + "\n")
    user = getpass.getuser()
    port = _free_port()
    config = workdir / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}", f"PidFile {workdir / 'sshd.pid'}",
        f"AuthorizedKeysFile {workdir / 'authorized_keys'}", "PubkeyAuthentication yes",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
        "StrictModes no",  # the tmp folder's parents are world-writable (/tmp is 1777)
        f"AllowUsers {user}", "PermitRootLogin prohibit-password", "Subsystem sftp internal-sftp",
        "LogLevel VERBOSE", "",
    ]))
    made_privsep = False
    if os.geteuid() == 0 and not os.path.isdir(PRIVSEP):
        os.makedirs(PRIVSEP, mode=0o755)
        made_privsep = True
    log = workdir / "sshd.log"
    proc = subprocess.Popen([binary, "-D", "-f", str(config), "-E", str(log)], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited with {proc.returncode}: {log.read_text() if log.exists() else ''}")
        # sshd writes its pid file once it listens: wait for that rather than connecting (a probe would
        # show up in its log as a connection, and tests read the log to prove nobody connected)
        if (workdir / "sshd.pid").exists() and (workdir / "sshd.pid").read_text().strip():
            break
        time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("sshd did not listen within 10 s")
    return SshdServer(f"{user}@127.0.0.1:{port}", user, port, client_key, log, proc), made_privsep


def stop_sshd(server: SshdServer, made_privsep: bool) -> None:
    """End the sshd we started, by its PID (SIGTERM, then SIGKILL)."""
    server.proc.terminate()
    try:
        server.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(timeout=5)
    if made_privsep:
        shutil.rmtree(PRIVSEP, ignore_errors=True)


#: whether `hold_privsep_dir` created PRIVSEP for this run
_held_privsep = False


def hold_privsep_dir(config) -> None:
    """pytest-xdist controller, as root: create PRIVSEP before any worker starts, so that no worker's test
    (which removes what it created) takes it away under another worker's running sshd."""
    global _held_privsep
    distributed = getattr(config.option, "dist", "no") != "no" and getattr(config.option, "tx", None)
    if distributed and not hasattr(config, "workerinput") and os.geteuid() == 0 and not os.path.isdir(PRIVSEP):
        os.makedirs(PRIVSEP, mode=0o755)
        _held_privsep = True


def release_privsep_dir() -> None:
    """Remove PRIVSEP again if `hold_privsep_dir` created it."""
    global _held_privsep
    if _held_privsep:
        shutil.rmtree(PRIVSEP, ignore_errors=True)
        _held_privsep = False


@pytest.fixture
def sshd_server(tmp_path):
    server, made = start_sshd(tmp_path / "sshd")
    try:
        yield server
    finally:
        stop_sshd(server, made)
