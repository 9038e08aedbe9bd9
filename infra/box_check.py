"""Is this a box the trainer can run on? GPU and driver, free disk, the slime image's pieces, Python imports.

Standard library only, so the same file runs in two ways: imported by `infra.launch_gpu` on the box, and
sent as the program text of `python3 -c` over SSH before anything is shipped (infra/remote). It prints one
JSON report on stdout; every failed check is also one line on stderr naming what is missing and the fix,
and the exit status is 1 if any check failed.

    python3 infra/box_check.py --remote-dir /root/dRL --slime-dir /root/slime --megatron-dir /root/Megatron-LM
    python3 infra/box_check.py --remote-dir /root/dRL --engine native   # any CUDA box with torch (no slime)
    python3 infra/box_check.py --ensure-deps "pydantic>=2.7" ...   # pip-install only what does not import
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

#: free disk a run needs when its launch names no figure (the launch passes its recipe's: infra.slime_launch.
#: disk_floor_gb); DRL_MIN_FREE_GB overrides either, for a box that is small on purpose
MIN_FREE_GB = 100.0


def min_free_override(env=None) -> float | None:
    """DRL_MIN_FREE_GB (None when unset): the free disk a box small on purpose is held to instead of the recipe's
    figure. A value that is not a number of GB at least 0 is refused in one sentence (ValueError)."""
    value = (os.environ if env is None else env).get("DRL_MIN_FREE_GB", "").strip()
    if not value:
        return None
    try:
        gb = float(value)
    except ValueError:
        gb = -1.0
    if not gb >= 0:
        raise ValueError(f"DRL_MIN_FREE_GB={value!r} must be a number of GB at least 0 (e.g. DRL_MIN_FREE_GB=50)")
    return gb


def required_free_gb(launch_gb: float | None = None) -> float:
    """DRL_MIN_FREE_GB as it is set when the check runs, else the launch's figure, else MIN_FREE_GB."""
    override = min_free_override()
    return override if override is not None else MIN_FREE_GB if launch_gb is None else launch_gb
#: modules the trainer needs from the slime image (importable with Megatron-LM on PYTHONPATH)
IMAGE_IMPORTS = ("torch", "ray", "slime", "megatron.core", "sglang", "transformers", "huggingface_hub",
                 "safetensors")
#: the native engine: what the image must bring (a CUDA torch above all) ...
NATIVE_IMPORTS = ("torch", "transformers", "huggingface_hub", "safetensors")
#: ... and what the launch installs from the package index when it does not import (module -> requirement)
NATIVE_INSTALLABLE = {"megatron.core": "megatron-core>=0.16.1", "ray": "ray[default]>=2.40"}


def check_gpu(image: str = "the slimerl/slime image") -> dict:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"ok": False, "error": "nvidia-smi: not found: no NVIDIA driver on this box; rent a box with "
                f"an H100/H200 (80 GB) and {image}"}
    out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0 or not out.stdout.strip():
        return {"ok": False, "error": f"nvidia-smi failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}"}
    gpus = []
    for line in out.stdout.strip().splitlines():
        name, driver, mem = (x.strip() for x in line.split(","))
        gpus.append({"name": name, "driver": driver, "memory_mib": int(float(mem))})
    return {"ok": True, "gpus": gpus}


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _dir_gb(path: str) -> float:
    """Bytes already under `path` (a redeploy's models and checkpoints), in GB."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total / 1e9


def check_disk(path: str, min_free_gb: float | None = None, already_used_gb: float = 0.0) -> dict:
    """Free space where the run writes; space the run already holds there counts as available."""
    where = _existing_ancestor(path)
    free_gb = shutil.disk_usage(where).free / 1e9
    min_free_gb = required_free_gb(min_free_gb)
    ok = free_gb + already_used_gb >= min_free_gb
    out = {"ok": ok, "path": where, "free_gb": round(free_gb, 1)}
    if not ok:
        out["error"] = (f"only {free_gb:.0f} GB free at {where}; the model, its Megatron copy and checkpoints "
                        f"need about {min_free_gb:.0f} GB: rent a bigger disk or set REMOTE_DIR elsewhere")
    return out


def check_dirs(slime_dir: str, megatron_dir: str) -> dict:
    missing = [d for d in (slime_dir, megatron_dir) if not os.path.isdir(d)]
    if missing:
        return {"ok": False, "error": f"missing {', '.join(missing)}: use the slimerl/slime image (it has "
                "slime at /root/slime and Megatron-LM at /root/Megatron-LM)"}
    return {"ok": True}


def check_slime(slime_dir: str) -> dict:
    """slime's commit (`git log -1`): what the patch step and the launch log name; the patches themselves
    are decided from slime's code (infra/patches/probes.py), not from this."""
    # the ceiling keeps git from answering with an enclosing repository's commit
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": os.path.dirname(os.path.abspath(slime_dir))}
    res = subprocess.run(["git", "-C", slime_dir, "log", "-1", "--format=%H %cs"], capture_output=True, text=True,
                         env=env, check=False) if shutil.which("git") else None
    if res is None or res.returncode != 0 or not res.stdout.strip():
        return {"ok": True, "commit": "unknown (not a git checkout)"}
    sha, date = res.stdout.split()
    return {"ok": True, "commit": sha, "date": date}


def check_imports(megatron_dir: str, python: str = sys.executable, modules=IMAGE_IMPORTS, present=()) -> dict:
    """`modules` must import with `python`; `present` need only be installed (found, not imported: what the
    launch would pip-install when missing, where importing megatron-core alone costs seconds of CPU and pip
    would not reinstall a present package that fails to import either)."""
    code = ("import importlib,importlib.util,json\nbad={}\nfor m in " + repr(tuple(modules)) + ":\n"
            "    try: importlib.import_module(m)\n"
            "    except Exception as e: bad[m]=type(e).__name__+': '+str(e)[:200]\n"
            "for m in " + repr(tuple(present)) + ":\n"
            "    try: found=importlib.util.find_spec(m) is not None\n"
            "    except Exception: found=False\n"
            "    if not found: bad[m]='not installed'\nprint(json.dumps(bad))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (megatron_dir, os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        return {"ok": False, "error": f"{python} could not run: {res.stderr.strip()[-500:]}"}
    bad = json.loads(res.stdout.strip().splitlines()[-1])
    if bad:
        return {"ok": False, "error": "cannot import " + "; ".join(f"{m} ({e})" for m, e in bad.items())
                + ": use the slimerl/slime image", "missing": sorted(bad)}
    return {"ok": True}


def check_native_imports(python: str = sys.executable) -> dict:
    """The native engine's packages: the image's must import; megatron-core and ray are listed for install."""
    report = check_imports("", python, NATIVE_IMPORTS, present=tuple(NATIVE_INSTALLABLE))
    if not report["ok"] and "missing" not in report:  # the Python itself did not run
        return report
    missing = report.pop("missing", [])
    must = [m for m in missing if m not in NATIVE_INSTALLABLE]
    if must:
        return {"ok": False, "error": f"cannot import {', '.join(must)} with {python}: use an image with a CUDA "
                "torch and transformers (a plain PyTorch image will do)", "missing": missing}
    return {"ok": True, "installable": [NATIVE_INSTALLABLE[m] for m in missing]}


def reused_gb(remote_dir: str, run: str | None, model_dirs=()) -> float:
    """What the disk figure already has on the box: the recipe's own model directories (a redeploy downloads
    them again into the same place; `model_dirs`, infra.slime_launch.reused_model_dirs) and this run's own
    directory (its checkpoints, which a resume replaces in turn). Other models and other runs' files are not
    this launch's room."""
    run_dir = [os.path.join(remote_dir, ".stoa", "runs", run)] if run else []
    return sum(_dir_gb(d) for d in [*model_dirs, *run_dir])


def run_checks(remote_dir: str, slime_dir: str, megatron_dir: str, min_free_gb: float | None = None,
               engine: str = "slime", run: str | None = None, model_dirs=()) -> dict:
    """Every check of `engine` (slime: the slime image; native: any CUDA box with torch); `ok` only if all pass."""
    if engine == "native":
        report = {"gpu": check_gpu("a CUDA PyTorch image"),
                  "disk": check_disk(remote_dir, min_free_gb, reused_gb(remote_dir, run, model_dirs)),
                  "imports": check_native_imports()}
        report["ok"] = all(v["ok"] for v in report.values())
        return report
    report = {
        "gpu": check_gpu(),
        "disk": check_disk(remote_dir, min_free_gb, reused_gb(remote_dir, run, model_dirs)),
        "image": check_dirs(slime_dir, megatron_dir),
    }
    report["imports"] = check_imports(megatron_dir) if report["image"]["ok"] else {
        "ok": False, "error": "skipped: the image's slime/Megatron-LM directories are missing"}
    if report["image"]["ok"]:
        report["slime"] = check_slime(slime_dir)
    report["ok"] = all(v["ok"] for v in report.values())
    return report


def ensure_deps(requirements: list[str], python: str = sys.executable) -> list[str]:
    """pip-install each requirement whose module is not installed; returns what was installed."""
    modules = {}
    for req in requirements:
        name = req.split(";")[0]
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        modules[req] = {"pyyaml": "yaml", "huggingface-hub": "huggingface_hub",
                        "megatron-core": "megatron.core"}.get(name.lower(), name.replace("-", "_"))
    report = check_imports("", python, (), present=tuple(modules.values()))
    if not report["ok"] and "missing" not in report:  # the Python itself did not run
        raise RuntimeError(report["error"])
    todo = [req for req, module in modules.items() if module in report.get("missing", ())]
    if todo:
        subprocess.run([python, "-m", "pip", "install", "--quiet", *todo], check=True)
    return todo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="check a GPU box for the stoa trainer")
    ap.add_argument("--remote-dir", default="/root/dRL")
    ap.add_argument("--slime-dir", default="/root/slime")
    ap.add_argument("--megatron-dir", default="/root/Megatron-LM")
    ap.add_argument("--min-free-gb", type=float, default=None,
                    help="free disk the run needs (the launch passes its recipe's; DRL_MIN_FREE_GB overrides it; "
                         "default 100)")
    ap.add_argument("--engine", choices=("slime", "native"), default="slime")
    ap.add_argument("--run", help="the run id: its own directory's files count toward the free disk (a resume)")
    ap.add_argument("--model-dir", action="append", default=[],
                    help="a directory of the recipe's model the launch reuses (counts toward the free disk; repeatable)")
    ap.add_argument("--ensure-deps", nargs="+", metavar="REQ", help="install these requirements if missing")
    args = ap.parse_args(argv)
    if args.min_free_gb is not None and not args.min_free_gb >= 0:  # stdlib only: no worker_contract.cli.number
        ap.error(f"argument --min-free-gb: {args.min_free_gb:g} is out of range: give a number at least 0")
    if args.ensure_deps:
        installed = ensure_deps(args.ensure_deps)
        print(json.dumps({"ok": True, "installed": installed}))
        return 0
    try:
        report = run_checks(args.remote_dir, args.slime_dir, args.megatron_dir, args.min_free_gb, engine=args.engine,
                            run=args.run, model_dirs=args.model_dir)
    except ValueError as e:  # DRL_MIN_FREE_GB that is not a number: one sentence, as every entry point says it
        print(f"box check: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    for name, check in report.items():
        if isinstance(check, dict) and not check["ok"]:
            print(f"box check {name}: {check['error']}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
