"""Deploy steps over SSH: check the box, ship the tree, ship the credentials, install missing dependencies;
`remote_steps`: the remote launch's one list of steps (the plan and the launch read it).

Each step is idempotent. The tree travels as one deterministic tar.gz over SFTP (no rsync needed on either
side); its sha256 and file list are kept on the box, so an unchanged tree is not shipped again and files
deleted locally are deleted remotely. Credentials never appear on a command line: they are written over
SFTP into a file created with mode 0600 beforehand, then renamed into place.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..launch_plan import LaunchStep
from ..steps import Step
from .ssh import RemoteStepError, q, run

#: directories never shipped (virtual envs, local run state, VCS, caches)
EXCLUDE_DIRS = frozenset({".venv", ".stoa", ".git", ".nox", "__pycache__", ".pytest_cache", ".ruff_cache",
                          ".mypy_cache", "node_modules", ".idea", ".vscode"})
TREE_DIGEST = ".stoa-tree.sha256"
TREE_FILES = ".stoa-tree.files"
ENV_FILE = ".r2env"


#: file names that hold secrets by convention (SSH keys, cloud credentials, env files, keystores)
SECRET_NAMES = frozenset({"id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", "id_ecdsa_sk", "id_ed25519_sk",
                          "credentials", "credentials.json", "credentials.csv", ".netrc", ".pgpass", ".pypirc",
                          ".npmrc", ".git-credentials", "authorized_keys", "known_hosts"})
SECRET_SUFFIXES = (".key", ".pem", ".env", ".p12", ".pfx", ".jks", ".keystore", ".ppk", ".kdbx", ".gpg", ".asc")


def is_private_file(name: str) -> bool:
    """Credential, key and env files stay home, tracked or not (`.r2env` travels only through
    `ship_credentials`); only their `.example` templates travel."""
    if name.endswith(".example"):
        return False
    return (name in SECRET_NAMES or name.startswith((".r2env", ".env", "id_rsa", "id_ed25519", "id_ecdsa"))
            or name.endswith(SECRET_SUFFIXES) or (name.startswith("service-account") and name.endswith(".json")))


def _shippable(rel: str) -> bool:
    parts = rel.split("/")
    return (not any(p in EXCLUDE_DIRS or p.endswith(".egg-info") for p in parts[:-1])
            and not parts[-1].endswith((".pyc", ".pyo")) and not is_private_file(parts[-1]))


def _git_files(root: Path) -> list[str] | None:
    """The files git tracks when `root` is a git checkout: an untracked file (a card.env written here, a
    key dropped in) never travels; `git add` a new file to ship it."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.resolve().parent)}
    try:
        res = subprocess.run(["git", "ls-files", "-z", "--cached"], cwd=root,
                             env=env, capture_output=True, check=False)
    except OSError:
        return None
    if res.returncode != 0:
        return None
    return [f for f in res.stdout.decode().split("\0") if f]


def tree_files(root: str | Path) -> list[str]:
    """The trainer-side tree: the files git tracks (or every file, outside git), less excluded dirs,
    secret-like names (`is_private_file`) and bytecode."""
    root = Path(root)
    listed = _git_files(root)
    if listed is not None:
        return sorted(f for f in listed if _shippable(f) and (root / f).is_file() and not (root / f).is_symlink())
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDE_DIRS and not d.endswith(".egg-info"))
        for f in sorted(filenames):
            if f.endswith((".pyc", ".pyo")) or is_private_file(f):
                continue
            path = Path(dirpath) / f
            if path.is_file() and not path.is_symlink():
                out.append(path.relative_to(root).as_posix())
    return sorted(out)


@dataclass(frozen=True)
class Tarball:
    data: bytes
    digest: str
    files: list[str]


def build_tarball(root: str | Path) -> Tarball:
    """A byte-for-byte reproducible tar.gz of the tree (fixed mtimes and owners), and its sha256."""
    root = Path(root)
    files = tree_files(root)
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for rel in files:
            path = root / rel
            info = tarfile.TarInfo(rel)
            info.size = path.stat().st_size
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(path, "rb") as f:
                tar.addfile(info, f)
    data = raw.getvalue()
    return Tarball(data, hashlib.sha256(data).hexdigest(), files)


def _read_remote(conn, path: str) -> str | None:
    res = conn.run(f"cat {q(path)} 2>/dev/null", warn=True, hide=True, in_stream=False)
    return res.stdout if res.exited == 0 else None


def _box_check_source() -> str:
    return (Path(__file__).resolve().parent.parent / "box_check.py").read_text()


def check_box(conn, *, remote_dir: str, slime_dir: str, megatron_dir: str, min_free_gb: float,
              python: str = "python3", engine: str = "slime", run_id: str | None = None, model_dirs=()) -> str:
    """Run infra/box_check.py on the box (its source as `python3 -c`, nothing shipped yet)."""
    cmd = (f"{q(python)} -c {q(_box_check_source())} --remote-dir {q(remote_dir)} --slime-dir {q(slime_dir)} "
           f"--megatron-dir {q(megatron_dir)} --engine {q(engine)} --min-free-gb {min_free_gb:g}"
           + (f" --run {q(run_id)}" if run_id else "") + "".join(f" --model-dir {q(d)}" for d in model_dirs))
    res = run(conn, "check_box", cmd)
    report = json.loads(res.stdout.strip().splitlines()[-1])
    gpus = ", ".join(f"{g['name']} (driver {g['driver']})" for g in report["gpu"]["gpus"])
    return f"{gpus}; {report['disk']['free_gb']} GB free at {report['disk']['path']}"


def ship_tree(conn, root: str | Path, remote_dir: str) -> str:
    """Ship the tree unless the box already has this exact tarball; delete files removed since."""
    tb = build_tarball(root)
    rd = PurePosixPath(remote_dir)
    run(conn, "ship_tree", f"mkdir -p {q(rd)}")
    if (_read_remote(conn, str(rd / TREE_DIGEST)) or "").strip() == tb.digest:
        return f"unchanged ({len(tb.files)} files, sha256 {tb.digest[:12]}), not shipped again"
    partial = rd / ".stoa-tree.tar.gz.partial"
    new_list = rd / (TREE_FILES + ".new")
    sftp = conn.sftp()
    sftp.putfo(io.BytesIO(tb.data), str(partial))
    sftp.putfo(io.BytesIO(("\n".join(tb.files) + "\n").encode()), str(new_list))
    old_list = rd / TREE_FILES
    # Files of the previous deploy that are not in this one are removed (grep -vxF: exact whole lines).
    script = (
        f"set -e; cd {q(rd)}; tar -xzf {q(partial)} -o; rm -f {q(partial)}; "
        f"if [ -f {q(old_list)} ]; then grep -vxF -f {q(new_list)} {q(old_list)} | "
        f"while IFS= read -r f; do rm -f -- \"$f\"; done; fi; "
        f"mv -f {q(new_list)} {q(old_list)}; printf %s {q(tb.digest)} > {q(TREE_DIGEST)}.tmp; "
        f"mv -f {q(TREE_DIGEST)}.tmp {q(TREE_DIGEST)}"
    )
    run(conn, "ship_tree", script)
    return f"{len(tb.files)} files, {len(tb.data) / 1e6:.1f} MB, sha256 {tb.digest[:12]}"


def credentials_text(values: Mapping[str, str]) -> str:
    return "".join(f"{k}={v}\n" for k, v in values.items())


def ship_credentials(conn, remote_dir: str, values: Mapping[str, str]) -> str:
    """Write the credentials to <remote_dir>/.r2env with mode 0600 from its first byte."""
    rd = PurePosixPath(remote_dir)
    target, tmp = rd / ENV_FILE, rd / (ENV_FILE + ".partial")
    text = credentials_text(values).encode()
    digest = hashlib.sha256(text).hexdigest()
    res = conn.run(f"sha256sum {q(target)} 2>/dev/null; stat -c %a {q(target)} 2>/dev/null",
                   warn=True, hide=True, in_stream=False)
    lines = res.stdout.split()
    if res.exited == 0 and len(lines) >= 3 and lines[0] == digest and lines[-1] == "600":
        return f"{target} unchanged (mode 0600)"
    # umask 077 and an empty file created first: the file is never readable by anyone else, not even empty.
    run(conn, "ship_credentials", f"umask 077 && mkdir -p {q(rd)} && rm -f {q(tmp)} && : > {q(tmp)} "
                                  f"&& chmod 600 {q(tmp)}")
    with conn.sftp().open(str(tmp), "r+") as f:
        f.write(text)
    mode = run(conn, "ship_credentials", f"chmod 600 {q(tmp)} && mv -f {q(tmp)} {q(target)} && stat -c %a {q(target)}")
    if mode.stdout.strip() != "600":
        raise RemoteStepError("ship_credentials", "stat", 1, f"{target} has mode {mode.stdout.strip()}, expected 600")
    return f"{target} (mode 0600, {len(values)} values)"


def contract_requirements(repo_root: str | Path) -> list[str]:
    """The contract core's dependencies, read from pyproject.toml (one list, not a copy)."""
    data = tomllib.loads((Path(repo_root) / "pyproject.toml").read_text())
    return list(data["project"]["dependencies"])


def install_deps(conn, remote_dir: str, repo_root: str | Path, python: str = "python3",
                 extra: list[str] | tuple[str, ...] = ()) -> str:
    """The contract's dependencies and `extra` (the native engine: megatron-core, ray), only those missing."""
    reqs = contract_requirements(repo_root) + list(extra)
    cmd = f"{q(python)} -c {q(_box_check_source())} --ensure-deps " + " ".join(q(r) for r in reqs)
    res = run(conn, "install_deps", cmd)
    installed = json.loads(res.stdout.strip().splitlines()[-1])["installed"]
    return f"installed {', '.join(installed)}" if installed else "all present"


def write_recipe(conn, remote_dir: str, recipe_file: str, recipe_json: str) -> str:
    """The resolved recipe the box launch reads (no secrets: credentials are not recipe fields)."""
    run(conn, "write_recipe", f"mkdir -p {q(PurePosixPath(recipe_file).parent)}")
    conn.sftp().putfo(io.BytesIO(recipe_json.encode()), recipe_file)
    return recipe_file


@dataclass(frozen=True)
class RemoteLaunch:
    """What a remote launch step is given: the open connection and the launch's resolved values."""

    conn: Any
    host: str
    cfg: Any  # the resolved RecipeConfig (store and remote_dir set)
    recipe_file: str
    repo_root: str | Path
    python: str = "python3"
    creds: Mapping[str, str] = field(default_factory=dict)

    @property
    def remote_dir(self) -> str:
        return self.cfg.launch.remote_dir

    def recipe_json(self) -> str:
        return json.dumps(self.cfg.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"

    def box_command(self) -> str:
        # DRL_MIN_FREE_GB set here (a box small on purpose) holds on the box too: its check_box reads it there
        from ..box_check import min_free_override

        override = min_free_override()
        floor = f"DRL_MIN_FREE_GB={override:g} " if override is not None else ""
        return (f"cd {q(self.remote_dir)} && {floor}{q(self.python)} -m infra.launch_gpu "
                f"--recipe-json {q(str(PurePosixPath(self.recipe_file)))}")


def _disk_floor(cfg) -> float:
    """The free disk the recipe needs (infra.slime_launch.disk_floor_gb; the model's size from the built-in facts:
    nothing is downloaded yet), or DRL_MIN_FREE_GB as set on this machine."""
    from ..box_check import required_free_gb
    from ..slime_launch import KNOWN_HF_CONFIGS, disk_floor_gb

    return required_free_gb(disk_floor_gb(cfg, KNOWN_HF_CONFIGS.get(cfg.model.hf_id or "")))


def _model_dirs(r: RemoteLaunch) -> list[str]:
    """The recipe's model directories on the box, which its disk check counts as this launch's own room."""
    from ..slime_launch import BoxPaths, reused_model_dirs

    return reused_model_dirs(r.cfg, BoxPaths(remote_dir=r.remote_dir, run=r.cfg.run))


def _native_extra(r: RemoteLaunch) -> list[str]:
    from ..box_check import NATIVE_INSTALLABLE

    return list(NATIVE_INSTALLABLE.values()) if r.cfg.train.engine == "native" else []  # a plain PyTorch image


def remote_steps(engine: str) -> list[Step]:
    """The steps a launch over SSH takes before the box's own ones, in order (the plan prints `info`,
    infra/remote's launch runs them with a RemoteLaunch)."""
    native = engine == "native"

    def step(name: str, summary: str, run_: Callable[[RemoteLaunch], str], gpu_only: bool = False) -> Step:
        return Step(LaunchStep(name=name, where="local" if name == "connect" else "remote", summary=summary,
                               gpu_only=gpu_only), run_)

    return [
        step("connect", "open the SSH connection (Fabric; key-only if SSH_KEY)",
             lambda r: (run(r.conn, "connect", "true"), f"connected to {r.host}")[1]),
        step("check_box", "nvidia-smi, the recipe's free disk, torch and transformers import (infra/box_check.py "
             "--engine native)" if native else "nvidia-smi, the recipe's free disk, slime/Megatron-LM dirs, Python "
             "imports (infra/box_check.py)",
             lambda r: check_box(r.conn, remote_dir=r.remote_dir, slime_dir=r.cfg.launch.slime_dir,
                                 megatron_dir=r.cfg.launch.megatron_dir, python=r.python, engine=engine,
                                 min_free_gb=_disk_floor(r.cfg), run_id=r.cfg.run,
                                 model_dirs=_model_dirs(r)),
             gpu_only=True),
        step("ship_tree", "tar of the tree (no .venv/.stoa/.git/.r2env) over SFTP; skipped when its digest matches",
             lambda r: ship_tree(r.conn, r.repo_root, r.remote_dir)),
        step("ship_credentials", "R2 values to <remote_dir>/.r2env, created 0600 before any byte is written",
             lambda r: ship_credentials(r.conn, r.remote_dir, r.creds)),
        step("install_deps", "pip-install the contract's dependencies, megatron-core and ray, only what does not "
             "import" if native else "pip-install only the contract's missing dependencies",
             lambda r: install_deps(r.conn, r.remote_dir, r.repo_root, r.python, extra=_native_extra(r))),
        step("write_recipe", "the resolved recipe to <state>/recipe.json",
             lambda r: write_recipe(r.conn, r.remote_dir, r.recipe_file, r.recipe_json())),
        step("box_launch", "python3 -m infra.launch_gpu on the box: the on-box steps below",
             lambda r: (run(r.conn, "box_launch", r.box_command(), stream=True), "trainer launched")[1],
             gpu_only=True),
    ]
