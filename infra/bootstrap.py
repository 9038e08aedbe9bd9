"""Install the project with its dev extras into the venv that runs this file: uv where it can, pip where not.

`make setup` runs it (`.venv/bin/python infra/bootstrap.py`). uv resolves and installs the same requirements
in seconds; pip takes about two minutes on a 2-core box, resolving, downloading and unpacking one package
at a time. uv reads no pip configuration, so the pip settings that say where packages come from (indexes,
find-links, constraints, a CA bundle, from pip.conf or PIP_* variables) are handed to it. pip installs
instead, as it always did, in a venv that sees the system's packages (the slime image's CUDA torch, which
uv would install over), when pip has a setting uv is not given, and when uv cannot be had or fails.
Either way the bytecode is compiled after, on every core. Standard library only: nothing of the project is
installed yet when it runs.
"""

from __future__ import annotations

import argparse
import compileall
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
#: pip settings and the uv flag that does the same (each may hold several values, space-separated)
UV_FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
            "constraint": "--constraint"}
#: pip settings that change nothing about which packages are installed
INERT = {"default-timeout", "timeout", "disable-pip-version-check", "no-compile", "progress-bar", "quiet",
         "verbose", "root-user-action", "no-input", "cache-dir", "no-cache-dir", "retries", "config-file"}


def say(line: str) -> None:
    print(line, flush=True)


def run(argv: list[str], **kw) -> int:
    say("+ " + shlex.join(argv))
    return subprocess.run(argv, **kw).returncode


def pip_settings(python: str) -> dict[str, list[str]]:
    """The pip settings in force here (`pip config list`: its files and PIP_* variables), by name."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    settings: dict[str, list[str]] = {}
    for line in out.splitlines():  # e.g. global.find-links='/opt/wheels', :env:.constraint='/x.txt'
        name, _, value = line.partition("=")
        values = settings.setdefault(name.rsplit(".", 1)[-1], [])
        values += [v for v in value.strip("'\"").split() if v not in values]  # a file and a variable may agree
    return settings


def sees_system_packages() -> bool:
    cfg = (Path(sys.prefix) / "pyvenv.cfg").read_text().splitlines()
    return any(line.replace(" ", "").lower() == "include-system-site-packages=true" for line in cfg)


def why_not_uv(settings: dict[str, list[str]]) -> str | None:
    """Why pip must install here, or None where uv can."""
    if sees_system_packages():
        return "the venv sees the system's packages, which uv would install over"
    unknown = sorted(set(settings) - set(UV_FLAGS) - INERT - {"cert"})
    return f"pip has settings uv is not given ({', '.join(unknown)})" if unknown else None


def uv_install(uv: str, python: str, settings: dict[str, list[str]]) -> tuple[list[str], dict[str, str]]:
    """`uv pip install` into `python`'s venv with pip's settings, and the environment it runs in."""
    # pip takes the newest version any index offers; uv would stop at the first index that has the package
    argv = [uv, "pip", "install", "--python", python, "--index-strategy", "unsafe-best-match"]
    for name, flag in UV_FLAGS.items():
        for value in settings.get(name, []):
            argv += [flag, value]
    env = dict(os.environ)
    if settings.get("cert"):
        env["SSL_CERT_FILE"] = settings["cert"][-1]
    return argv, env


def get_uv(python: str) -> str | None:
    """uv in the venv, installed there by pip when it is not (a wheel of about 20 MB)."""
    here = str(Path(python).parent)
    if shutil.which("uv", path=here) is None:
        run([python, "-m", "pip", "install", "--quiet", "--no-compile", "uv"])
    return shutil.which("uv", path=here)


def wants_cpu_torch(python: str) -> bool:
    """No torch yet and no NVIDIA GPU: the CPU build is pinned first, so no resolver pulls the CUDA one."""
    has_torch = subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0
    return not has_torch and shutil.which("nvidia-smi") is None


def install(cpu_torch: str, spec: str) -> None:
    python = sys.executable
    torch = [cpu_torch] if wants_cpu_torch(python) else []
    if torch:
        say(f"no NVIDIA GPU: installing {cpu_torch}")
    settings = pip_settings(python)
    why = why_not_uv(settings)
    uv = None if why else get_uv(python)
    if uv:
        argv, env = uv_install(uv, python, settings)
        if run([*argv, *torch, "-e", spec], cwd=REPO_ROOT, env=env) == 0:
            return
        why = "uv failed (above)"
    say(f"installing with pip: {why or 'uv could not be installed'}")
    pip = [python, "-m", "pip", "install", "--no-compile"]
    steps = [[*pip, "--quiet", "--upgrade", "pip"], *([[*pip, *torch]] if torch else []), [*pip, "-e", spec]]
    for argv in steps:
        if run(argv, cwd=REPO_ROOT) != 0:
            sys.exit(f"bootstrap: {shlex.join(argv)} failed")


def compile_bytecode() -> None:
    """pip compiles what it installs on one core and uv not at all; where PYTHONDONTWRITEBYTECODE is set, no
    process would ever write the bytecode, and every start would compile what it imports again."""
    paths = sysconfig.get_paths()
    say(f"compiling the venv's bytecode on {os.cpu_count() or 1} cores (about a minute on two)")
    for d in {paths["purelib"], paths["platlib"]}:
        compileall.compile_dir(d, quiet=2, workers=0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="infra/bootstrap.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-torch", default="torch==2.13.0", help="torch to install where there is no NVIDIA GPU")
    p.add_argument("--spec", default=".[dev]", help="what to install, editable, from the repository root")
    args = p.parse_args(argv)
    if sys.prefix == sys.base_prefix:
        sys.exit("bootstrap: run it with the venv's python (.venv/bin/python infra/bootstrap.py)")
    install(args.cpu_torch, args.spec)
    compile_bytecode()


if __name__ == "__main__":
    main()
