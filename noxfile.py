"""nox sessions: the one place that knows how to run tests, lint, preflight and benchmarks.

Sessions reuse the repo's `.venv` (made by `make setup`) instead of building their own, because the
learner stack (torch, ray, megatron-core) is about 2 GB and CI has 20 minutes. Sessions are named by verb.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

PY = sys.executable  # the interpreter nox runs under: .venv/bin/python via `make`


def _refuse(message: str) -> None:
    """Bad input to a session: one sentence and exit 2, as every entry point does (worker_contract/cli.py)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def _run_cli(session: nox.Session, *args: str) -> None:
    """Run one of our `python -m` CLIs and exit with its own status (nox would turn 2, bad input, and 1, a
    failed check, into the same 1)."""
    session.log(" ".join((PY, *args)))
    code = subprocess.run([PY, *args], check=False).returncode
    if code:
        raise SystemExit(code)


def _ensure_sshd(session: nox.Session) -> None:
    """The Fabric tests need a real sshd binary; install it through apt-get when we are root."""
    if shutil.which("sshd") or os.path.exists("/usr/sbin/sshd"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        session.warn("sshd missing and not root: the Fabric tests will be skipped")
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run("apt-get", "update", "-qq", external=True, env=env)
    session.run("apt-get", "install", "-y", "-qq", "--no-install-recommends", "openssh-server",
                external=True, env=env)


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Run the test suite (everything but `gpu`; pass `-- -m slow` etc. to narrow)."""
    _ensure_sshd(session)
    args = session.posargs or ["-m", "not gpu and not soak", "--durations=25"]
    session.run(PY, "-m", "pytest", *args)


@nox.session(venv_backend="none")
def soak(session: nox.Session) -> None:
    """Long fault-injection trials (crashes, store and worker faults, hostile records): `nox -s soak -- 30`
    runs 30 crash trials (default DRL_SOAK_TRIALS, else 20); figures go to bench/results/soak.json."""
    args = list(session.posargs)
    trials = args.pop(0) if args and args[0].isdigit() else os.environ.get("DRL_SOAK_TRIALS", "").strip() or "20"
    if not trials.isdigit() or int(trials) < 1:
        _refuse(f"DRL_SOAK_TRIALS={trials!r} must be an integer >= 1 (for example DRL_SOAK_TRIALS=20, or "
                "nox -s soak -- 20)")
    out = os.path.join("bench", "results", "soak.json")
    partial = out + ".partial"  # only a soak that passes replaces the figures docs/reliability.md quotes
    if os.path.exists(partial):
        os.remove(partial)
    # the commit the run starts on (the tree may move on while it runs); empty outside a git checkout
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    session.run(PY, "-m", "pytest", "-m", "soak", *args,
                env={"DRL_SOAK_TRIALS": trials, "DRL_SOAK_RESULTS": os.path.abspath(partial),
                     "DRL_SOAK_COMMIT": commit})
    os.replace(partial, out)
    session.log(f"soak figures written to {out}")


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """Static checks with ruff."""
    session.run(PY, "-m", "ruff", "check", ".")


@nox.session(venv_backend="none")
def preflight(session: nox.Session) -> None:
    """Check a launch before it happens: reads a dry run on stdin, or resolves the recipe itself."""
    _run_cli(session, "-m", "infra.preflight", *session.posargs)


@nox.session(venv_backend="none")
def fleet(session: nox.Session) -> None:
    """The fleet simulator at 16, 64 and 256 workers, a 64-worker cold-join storm, and the rollout source's
    reads one at a time against 16 at once at 256 (`-- --scale 16,64` etc. to narrow); figures go to
    bench/results/fleet.json."""
    args = session.posargs or ["--scale", "16,64,256", "--storm", "64", "--compare", "read_threads=1,16"]
    _run_cli(session, "-m", "bench.fleet", *args)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks; each writes bench/results/<name>.json with the machine and commit."""
    _run_cli(session, "-m", "bench", *session.posargs)


@nox.session(venv_backend="none")
def gpu_loop(session: nox.Session) -> None:
    """The whole loop on this GPU box through the native launch (`python -m bench.gpu_loop`): learning and
    throughput, results in bench/results/gpu_loop.json (needs a CUDA GPU; `-- --parts learning` for one)."""
    _run_cli(session, "-m", "bench.gpu_loop", *session.posargs)
