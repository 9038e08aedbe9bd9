"""nox sessions: the one place that knows how to run tests, lint, preflight and benchmarks.

Sessions reuse the repo's `.venv` (made by `make setup`) instead of building their own, because the
learner stack (torch, ray, megatron-core) is about 2 GB and CI has 20 minutes. Sessions are named by verb.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

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
    # three xdist workers, a test module (or one long test) each at a time, longest first (tests/conftest.py
    # orders, groups and splits them): most tests wait on the processes and servers they start, so more workers
    # than this 2-core CI box has cores keep both busy (`nox -s tests -- -n 0 ...` runs in one process)
    args = session.posargs or ["-m", "not gpu and not soak", "--durations=25", "-n", "3", "--dist", "loadfile",
                               "--no-loadscope-reorder"]
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
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    status = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True)
    clean = "" if status.returncode else ("1" if not status.stdout.strip() else "0")
    started, t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.monotonic()
    session.run(PY, "-m", "pytest", "-m", "soak", *args,
                env={"DRL_SOAK_TRIALS": trials, "DRL_SOAK_RESULTS": os.path.abspath(partial),
                     "DRL_SOAK_COMMIT": commit, "DRL_SOAK_CLEAN": clean,
                     "DRL_SOAK_COMMAND": " ".join(["nox", "-s", "soak", "--", trials, *args])})
    # the whole session's start and wall time (each test's record() knows only its own end)
    with open(partial) as f:
        doc = json.load(f)
    doc["started_at"] = started
    doc["session"] = {"wall_s": round(time.monotonic() - t0, 1), "trials": int(trials), "command": doc.get("command")}
    with open(partial, "w") as f:
        f.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
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
    """The fleet simulator at 16, 64 and 256 workers, a cold-join storm and the source's read threads.

    64 workers join at once in the storm; the rollout source reads one record at a time against 16 at once at
    256 workers (`-- --scale 16,64` etc. to narrow); figures go to bench/results/fleet.json."""
    args = session.posargs or ["--scale", "16,64,256", "--storm", "64", "--compare", "read_threads=1,16"]
    _run_cli(session, "-m", "bench.fleet", *args)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks; each writes bench/results/<name>.json with the machine and commit."""
    _run_cli(session, "-m", "bench", *session.posargs)


@nox.session(venv_backend="none")
def gpu_loop(session: nox.Session) -> None:
    """The whole loop on this GPU box through the native launch: learning and throughput (needs a CUDA GPU).

    `python -m bench.gpu_loop`; results in bench/results/gpu_loop.json (`-- --parts learning` for one part)."""
    _run_cli(session, "-m", "bench.gpu_loop", *session.posargs)


#: what the slime_compat venv holds: sglang as slime imports it (0.5.13 pins transformers 5.8.1), the CPU torch
#: this machine has (sglang's own torch pin is a CUDA build), no torchvision (tests/slime_compat_stub stands in)
SLIME_COMPAT_PINS = ["torch==2.13.0", "transformers==5.8.1"]
SLIME_COMPAT_NO_DEPS = ["sglang==0.5.13", "sglang-router==0.3.2"]
SLIME_COMPAT_DEPS = [
    # what importing slime, sglang's server args and Megatron-LM's source tree needs on CPU
    "triton", "orjson", "psutil", "pybase64", "requests", "pillow", "starlette", "IPython", "aiohttp", "pyzmq",
    "openai", "partial_json_parser", "dill", "sentencepiece", "wandb", "ray", "torch_memory_saver", "six", "xxhash",
    "einops", "safetensors", "tokenizers", "setproctitle", "fastapi", "uvicorn",
    # the project's own core and test runner (the repository itself is on the path, not installed)
    "ml_dtypes", "blake3", "numpy", "pydantic", "zstandard", "boto3", "cryptography", "pyyaml", "pytest",
]


def _copy_tree(session: nox.Session, src: str, dest: str) -> str:
    """A git checkout of `src` at its commit (`git archive`, committed again), so the patches change a copy."""
    if os.path.isdir(os.path.join(src, ".git")) or os.path.isfile(os.path.join(src, ".git")):
        os.makedirs(dest)
        archive = subprocess.run(["git", "-C", src, "archive", "HEAD"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    else:
        shutil.copytree(src, dest)
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=stoa", "-c", "user.email=stoa@localhost",
                                                 "commit", "-qm", f"copy of {src}"]):
        subprocess.run(["git", *args], cwd=dest, check=True)
    # files written within the index's own second look modified to git apply --3way ("racily clean")
    subprocess.run(["git", "update-index", "-q", "--really-refresh"], cwd=dest, check=False)
    return dest


@nox.session(venv_backend="venv")
def slime_compat(session: nox.Session) -> None:
    """Our slime engine against real slime on CPU: `nox -s slime_compat -- SLIME_DIR MEGATRON_DIR [pytest args]`.
    In its own venv (sglang 0.5.13, transformers 5.8.1, not the project's .venv); patches a copy of slime
    and runs tests/slime_compat_checks.py. Not part of `make test` (CI has no slime); results: docs/slime.md."""
    import tempfile

    if len(session.posargs) < 2 or not all(os.path.isdir(d) for d in session.posargs[:2]):
        session.error("usage: nox -s slime_compat -- SLIME_DIR MEGATRON_DIR (a slime checkout and a Megatron-LM "
                      "checkout; get them with git clone of THUDM/slime and NVIDIA/Megatron-LM)")
    for d, marker, what in ((session.posargs[0], "slime/__init__.py", "slime"),
                            (session.posargs[1], "megatron/core/__init__.py", "Megatron-LM")):
        if not os.path.isfile(os.path.join(d, marker)):  # before minutes of installs, not after
            _refuse(f"{d} is not a {what} checkout (no {marker}): nox -s slime_compat -- SLIME_DIR MEGATRON_DIR")
    slime_dir, megatron_dir = (os.path.abspath(d) for d in session.posargs[:2])
    pins = os.path.join(session.create_tmp(), "pins.txt")
    with open(pins, "w") as f:
        f.write("\n".join(SLIME_COMPAT_PINS) + "\n")
    session.install("-c", pins, *SLIME_COMPAT_PINS)
    session.install("--no-deps", *SLIME_COMPAT_NO_DEPS)
    session.install("-c", pins, *SLIME_COMPAT_DEPS)
    work = tempfile.mkdtemp(prefix="stoa-slime-compat-")
    slime = _copy_tree(session, slime_dir, os.path.join(work, "slime"))
    megatron = _copy_tree(session, megatron_dir, os.path.join(work, "Megatron-LM"))
    # as slime's Dockerfile does: megatron.patch, then megatron-sglang-aligned.patch where the commit has it
    for name in ("megatron.patch", "megatron-sglang-aligned.patch"):
        mpatch = os.path.join(slime, "docker", "patch", "latest", name)
        if os.path.isfile(mpatch):
            session.log(f"applying {mpatch} to the Megatron-LM copy")
            subprocess.run(["git", "apply", "--3way", mpatch], cwd=megatron, check=True)
    session.run("python", "infra/patches/probes.py", "--tree", slime_dir)  # slime's commit, as given
    session.run("python", "-m", "infra.patches.apply", "--tree", slime)
    # the packages alone (links), not the checkouts' roots: both have a `tests` package that would shadow ours
    pkgs = os.path.join(work, "path")
    os.makedirs(pkgs)
    for name, root in (("megatron", megatron), ("slime", slime), ("slime_plugins", slime)):
        if os.path.isdir(os.path.join(root, name)):
            os.symlink(os.path.join(root, name), os.path.join(pkgs, name))
    path = os.pathsep.join([os.path.abspath("tests/slime_compat_stub"), os.getcwd(), pkgs])
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rA", "tests/slime_compat_checks.py",
                *session.posargs[2:], env={"PYTHONPATH": path, "STOA_SLIME_TREE": slime})
