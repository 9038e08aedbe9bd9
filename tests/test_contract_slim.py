"""The contract is slim and proves it: in a fresh venv holding only pyproject's core
dependencies and the project itself (--no-deps), every core module of worker_contract imports, and
neither torch, transformers, ray, megatron nor our trainer and infra packages get loaded."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = ["torch", "transformers", "ray", "megatron", "mlx", "trainer", "infra"]
CORE = ["worker_contract.env", "worker_contract.joincard", "worker_contract.layout", "worker_contract.manifest",
        "worker_contract.schema", "worker_contract.signing", "worker_contract.store",
        "worker_contract.store.file", "worker_contract.store.s3"]

CHECK = """
import importlib, json, pkgutil, sys
import worker_contract
mods, errors = [], {}
for m in pkgutil.walk_packages(worker_contract.__path__, "worker_contract."):
    if m.name == "worker_contract.worker" or m.name.startswith("worker_contract.worker."):
        continue  # the reference worker: torch, behind the `worker` extra
    try:
        importlib.import_module(m.name)
        mods.append(m.name)
    except Exception as e:
        errors[m.name] = f"{type(e).__name__}: {e}"
from worker_contract.store import open_store
s3 = open_store("s3://slim-check", {"DRL_S3_ENDPOINT": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "slimk",
                                    "AWS_SECRET_ACCESS_KEY": "slims"})  # builds a boto3 client, no request
print(json.dumps({"file": worker_contract.__file__, "modules": mods, "errors": errors,
                  "loaded": sorted({n.split(".")[0] for n in sys.modules}), "s3": s3.url}))
"""


def _installer(py: str) -> tuple[list[str], dict[str, str] | None]:
    """Installs into `py`'s venv as `make setup` does: uv with this machine's pip settings where the project's
    venv has it (seconds), else pip. Either way nothing is byte-compiled: the check imports each module once."""
    from infra.bootstrap import uv_plan

    plan = uv_plan(py, fetch=False)
    if isinstance(plan, str):
        return [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"], None
    argv, env = plan
    return [*argv, "--quiet"], env


def test_contract_core_installs_and_imports_alone(tmp_path):
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    src = tmp_path / "src"
    src.mkdir()
    shutil.copytree(REPO / "worker_contract", src / "worker_contract",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    install, env = _installer(py)
    subprocess.run(install + deps, check=True, timeout=300, capture_output=True, env=env)
    subprocess.run(install + ["--no-deps", str(src)], check=True, timeout=300, capture_output=True, env=env)

    r = subprocess.run([py, "-I", "-c", CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["file"].startswith(str(venv)), report["file"]  # the installed copy, not the checkout
    assert report["errors"] == {}, f"core modules that need more than the core dependencies: {report['errors']}"
    assert set(CORE) <= set(report["modules"])
    assert "boto3" in report["loaded"] and report["s3"] == "s3://slim-check"
    assert sorted(set(FORBIDDEN) & set(report["loaded"])) == []
