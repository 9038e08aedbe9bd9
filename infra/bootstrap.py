"""Install the project with its dev extras into the venv that runs this file: uv where it can, pip where not.

`make setup` runs it. uv installs the same requirements in seconds; pip takes about two minutes on a 2-core
box, one package at a time. uv reads no pip configuration, so pip's own parser is asked which `pip install`
options this machine sets (indexes, find-links, constraints, a CA bundle), and uv is handed them. pip
installs instead, as it always did, in a venv that sees the system's packages (the slime image's CUDA torch,
which uv would install over), when pip sets something uv is not given, and when uv cannot be had or fails.
Either way the bytecode is compiled after, on every core. Standard library and pip only: nothing of the
project is installed yet when it runs.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
#: `pip install`'s options as pip itself reads them: its config files' sections in pip's order, PIP_* variables
#: (pip._internal: no public API says this; a pip without it makes pip_settings None, and pip installs)
_PIP_OPTIONS = ("import json; from pip._internal.commands import create_command; "
                "print(json.dumps(vars(create_command('install').parse_args([])[0]), default=str))")
#: pip options that change nothing about which packages are installed, or how they are fetched
INERT = {"timeout", "disable_pip_version_check", "quiet", "verbose", "no_color", "progress_bar", "cache_dir",
         "retries", "resume_retries", "log", "no_input", "root_user_action", "compile", "require_venv",
         "warn_script_location", "warn_about_conflicts", "no_python_version_warning", "debug_mode"}
#: pip options uv is given (uv_install says how)
GIVEN = {"index_url", "extra_index_urls", "find_links", "constraints", "cert"}


def say(line: str) -> None:
    print(line, flush=True)


def run(argv: list[str], **kw) -> int:
    say("+ " + shlex.join(argv))
    return subprocess.run(argv, **kw).returncode


def pip_settings(python: str) -> dict[str, object] | None:
    """The `pip install` options this machine's pip configuration sets (those that differ from pip's own
    defaults), as pip reads them; None when this pip cannot say."""

    def options(env: dict[str, str]) -> dict | None:
        out = subprocess.run([python, "-c", _PIP_OPTIONS], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
        try:
            return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
        except (IndexError, ValueError):
            return None

    bare = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    here, default = options(dict(os.environ)), options(bare)
    if here is None or default is None:
        return None
    return {k: v for k, v in here.items() if v != default.get(k)}


def sees_system_packages() -> bool:
    cfg = (Path(sys.prefix) / "pyvenv.cfg").read_text().splitlines()
    return any(line.replace(" ", "").lower() == "include-system-site-packages=true" for line in cfg)


def why_not_uv(settings: dict[str, object] | None) -> str | None:
    """Why pip must install here, or None where uv can."""
    if sees_system_packages():
        return "the venv sees the system's packages, which uv would install over"
    if settings is None:
        return "this pip could not list its settings"
    unknown = sorted(set(settings) - GIVEN - INERT)
    return f"pip has settings uv is not given ({', '.join(unknown)})" if unknown else None


def uv_install(uv: str, python: str, settings: dict[str, object]) -> tuple[list[str], dict[str, str]]:
    """`uv pip install` into `python`'s venv with pip's settings, and the environment it runs in: uv's own
    configuration files and UV_* variables are left out (pip's settings are the whole of it), and the
    indexes go in the environment, not the command line, which is printed (an index URL may hold a token)."""
    # pip takes the newest version any index offers; uv would stop at the first index that has the package
    argv = [uv, "pip", "install", "--no-config", "--python", python, "--index-strategy", "unsafe-best-match"]
    for value in settings.get("find_links") or []:
        argv += ["--find-links", value]
    for value in settings.get("constraints") or []:
        argv += ["--constraint", value]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    if settings.get("index_url"):
        env["UV_DEFAULT_INDEX"] = str(settings["index_url"])
    if settings.get("extra_index_urls"):
        env["UV_INDEX"] = " ".join(settings["extra_index_urls"])
    if settings.get("cert"):
        env["SSL_CERT_FILE"] = str(settings["cert"])
    return argv, env


def get_uv(python: str, fetch: bool = True) -> str | None:
    """uv in the venv; with `fetch`, installed there by pip when it is not (a wheel of about 20 MB)."""
    here = str(Path(python).parent)
    if fetch and shutil.which("uv", path=here) is None:
        run([python, "-m", "pip", "install", "--quiet", "--no-compile", "uv"])
    return shutil.which("uv", path=here)


def uv_plan(target: str, fetch: bool = True) -> tuple[list[str], dict[str, str]] | str:
    """`uv pip install` into `target`'s venv with this machine's pip settings, as (argv, env); or why pip
    must install instead. `fetch`: pip installs uv into this venv when it is not there."""
    settings = pip_settings(sys.executable)
    why = why_not_uv(settings)
    if why:
        return why
    uv = get_uv(sys.executable, fetch)
    return uv_install(uv, target, settings) if uv else "uv could not be had"


def wants_cpu_torch(python: str) -> bool:
    """No torch yet and no NVIDIA GPU: the CPU build is pinned first, so no resolver pulls the CUDA one."""
    has_torch = subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0
    return not has_torch and shutil.which("nvidia-smi") is None


def install(cpu_torch: str, spec: str) -> None:
    python = sys.executable
    torch = [cpu_torch] if wants_cpu_torch(python) else []
    if torch:
        say(f"no NVIDIA GPU: installing {cpu_torch}")
    plan = uv_plan(python)
    if not isinstance(plan, str):
        argv, env = plan
        # the venv's pip brought up to date too, as the pip path does first
        if run([*argv, "--upgrade-package", "pip", "pip", *torch, "-e", spec], cwd=REPO_ROOT, env=env) == 0:
            return
        plan = "uv failed (above)"
    say(f"installing with pip: {plan}")
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
