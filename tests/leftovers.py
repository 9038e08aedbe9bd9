"""Processes the suite started that outlived it: named with the test that started them, and ended.

Once, a whole suite passed and left a Ray actor of a killed learner running (its raylet gone, its parent
init), holding memory on the machine and naming no test. The controller puts a token of its own in the
environment (`STOA_TEST_SESSION`), which every process a test starts with the inherited environment carries,
Ray's workers too (they inherit their raylet's, which inherits its learner's). When the session ends, a
process still carrying the token (other than the controller) is a leftover: the terminal summary names it
with the test that was running when it started (pytest's PYTEST_CURRENT_TEST, inherited the same way) and it
is ended by PID. A process a test started with an environment of its own making carries no token and is not
seen here.
"""

from __future__ import annotations

import os
import uuid

import pytest

MARK = "STOA_TEST_SESSION"
#: seconds a process still exiting at the session's end is given before it counts as a leftover
GRACE_S = 10.0


class Leftovers:
    def __init__(self, token: str):
        self.token = token
        self.found: list[str] = []

    def _carriers(self) -> list:
        import psutil

        me, out = os.getpid(), []
        for p in psutil.process_iter(["pid"]):
            if p.pid == me:
                continue
            try:
                if p.environ().get(MARK) == self.token:
                    out.append(p)
            except (psutil.Error, OSError):  # gone, a zombie, or another user's
                continue
        return out

    @pytest.hookimpl(trylast=True)  # after xdist has ended its workers
    def pytest_sessionfinish(self, session):
        import psutil

        _, alive = psutil.wait_procs(self._carriers(), timeout=GRACE_S)
        for p in alive:
            try:
                env, cmd = p.environ(), " ".join(p.cmdline())[:160]
                p.kill()
            except psutil.Error:
                continue
            self.found.append(f"PID {p.pid} (started during {env.get('PYTEST_CURRENT_TEST', 'no test')}): {cmd}")

    def pytest_terminal_summary(self, terminalreporter):
        if self.found:
            terminalreporter.section("processes the tests left running (ended now)", yellow=True)
            for line in self.found:
                terminalreporter.line(line)


def pytest_configure(config):
    """As a plugin of its own (`-p leftovers`: its test runs it so, in a suite of one leaking test)."""
    register(config)


def register(config) -> None:
    """On the controller only (an xdist worker inherits the token and finds nothing of its own to end). The token
    is always new: a suite a test starts must not take the outer suite's processes for its own."""
    if hasattr(config, "workerinput") or config.pluginmanager.has_plugin("stoa-leftovers"):
        return
    token = os.environ[MARK] = uuid.uuid4().hex
    config.pluginmanager.register(Leftovers(token), "stoa-leftovers")
