"""SSH plumbing over Fabric: parse HOST, connect, run one named step and report its remote stderr."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from ..steps import StepFailed

HOST_RE = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>[A-Za-z0-9._-]+|\[[0-9a-fA-F:]+\])(?::(?P<port>\d+))?$")


@dataclass(frozen=True)
class HostSpec:
    user: str | None
    hostname: str
    port: int | None

    def __str__(self) -> str:
        return f"{self.user + '@' if self.user else ''}{self.hostname}{':' + str(self.port) if self.port else ''}"


def parse_host(host: str) -> HostSpec:
    """`user@box`, `user@box:2222`, `box` (a ~/.ssh/config alias); ValueError naming HOST otherwise."""
    m = HOST_RE.match(host or "")
    if not m:
        raise ValueError(f"HOST={host!r} is not an SSH destination; use HOST=user@box or HOST=user@box:port "
                         "(for example HOST=root@203.0.113.7:22)")
    port = int(m["port"]) if m["port"] else None
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"HOST={host!r}: port {port} is out of range 1-65535")
    return HostSpec(m["user"], m["host"].strip("[]"), port)


class RemoteStepError(StepFailed):
    """A remote command failed: the step, the command, its exit status and its stderr."""

    def __init__(self, step: str, command: str, exited: int | None, stderr: str, stdout: str = ""):
        from worker_contract.env import redact

        self.step, self.command, self.exited = step, redact(command), exited
        self.stderr, self.stdout = redact(stderr.strip()), redact(stdout.strip())
        tail = "\n".join(self.stderr.splitlines()[-40:]) or "\n".join(self.stdout.splitlines()[-20:])
        super().__init__(f"step {step} failed (exit {exited}) on the remote host\n  command: {self.command[:300]}"
                         f"\n  remote stderr:\n" + "\n".join(f"    {line}" for line in tail.splitlines()))


def connect(host: str, ssh_key: str | None = None, *, timeout: float = 20.0):
    """A Fabric Connection; with `ssh_key` only that key is offered (no agent, no default keys)."""
    from fabric import Connection

    spec = parse_host(host)
    kwargs: dict = {}
    if ssh_key:
        kwargs = {"key_filename": [ssh_key], "look_for_keys": False, "allow_agent": False}
    return Connection(host=spec.hostname, user=spec.user, port=spec.port, connect_timeout=timeout,
                      connect_kwargs=kwargs)


def run(conn, step: str, command: str, *, stream: bool = False, timeout: float | None = None):
    """Run `command` on the remote host as part of `step`; raise RemoteStepError with its stderr on failure.

    `stream` shows the output live (long steps); it is captured either way. Never put a secret in
    `command`: secrets travel only as file contents over SFTP.
    """
    res = conn.run(command, warn=True, hide=not stream, pty=False, in_stream=False, timeout=timeout)
    if res.exited != 0:
        raise RemoteStepError(step, command, res.exited, res.stderr, res.stdout)
    return res


def q(value: str) -> str:
    return shlex.quote(str(value))
