"""PaperSearchQA fleet: the decoupled trainer setup steps the GPU-box launch runs for the psqa recipe.

    install_lfm2_plugin  check that slime's Python imports our LFM2 modules (trainer.models.lfm2_*; the tree is
                         on the job's PYTHONPATH) and that the --spec hook builds the model's layer spec
    base_model           pull the LFM2.5-8B-A1B HF directory (and, for slime, its converted torch_dist) from
                         `bases/lfm25/` in the bucket (digests checked); when the base is absent: download from
                         the Hub, convert, and publish both there, manifest last (create-only), for the next box
    (both engines take their base this way; slime's other steps: apply_patches, publish_anchor, start_ray,
    launch_trainer, infra/launch_gpu.py; the native engine's: infra/native_launch.py)
More in docs/quickstart-gpu.md (module notes).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from worker_contract import layout
from worker_contract.store import NotFound, PreconditionFailed

BASE_NAME = "lfm25"
#: the model whose base the fleet shares through the bucket (`bases/<BASE_NAME>/`)
BASE_HF_ID = "LiquidAI/LFM2.5-8B-A1B"


def applies(cfg) -> bool:
    """Whether a launch takes these steps: the recipe trains the shared base's model (the psqa recipe's LFM2.5);
    keyed on the model, never on the task's name."""
    return cfg.model.hf_id == BASE_HF_ID
MANIFEST_FORMAT = 1
#: the parts of the shared base each engine reads: the native learner loads the HF directory, slime the torch_dist
ENGINE_PARTS = {"native": ("hf",), "slime": ("hf", "torch_dist")}


class BaseFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sha256: str
    bytes: int


class BaseManifest(BaseModel):
    """`bases/<name>/manifest.json`: what a complete shared base holds; written after every file."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    format: int = MANIFEST_FORMAT
    """Version of this format."""
    name: str
    """Base name (`lfm25`)."""
    hf_id: str
    """Hub repo the HF directory came from."""
    hf_revision: str | None = None
    """Hub commit sha that was downloaded (the model pin of REPRODUCE.md)."""
    files: dict[str, BaseFile]
    """`hf/<path>` and `torch_dist/<path>` -> digest and size."""
    created_at: float
    """Unix time of publication."""
    provenance: dict[str, str] = {}
    """Tool versions and commits on the box that built it (slime, Megatron-LM, transformers)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root).as_posix()) for p in root.rglob("*") if p.is_file())


def read_manifest(store, name: str = BASE_NAME) -> BaseManifest | None:
    try:
        return BaseManifest.model_validate_json(store.get(layout.base_manifest_key(name)))
    except NotFound:
        return None


def pull_base(store, manifest: BaseManifest, hf_dir: Path, td_dir: Path, name: str = BASE_NAME,
              parts: tuple[str, ...] = ("hf", "torch_dist")) -> int:
    """Download every file of the base's `parts` (skipping ones already present with the right digest); returns
    how many were fetched. A digest mismatch after download raises ValueError naming the file."""
    fetched = 0
    for rel, info in manifest.files.items():
        part, _, sub = rel.partition("/")
        if part not in parts:
            continue
        dest = (hf_dir if part == "hf" else td_dir) / sub
        if dest.is_file() and dest.stat().st_size == info.bytes and _sha256(dest) == info.sha256:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        store.download_file(layout.base_file_key(name, part, sub), tmp)
        got = _sha256(tmp)
        if got != info.sha256:
            tmp.unlink(missing_ok=True)
            raise ValueError(f"bases/{name}/{rel}: sha256 {got[:12]}... != manifest {info.sha256[:12]}...; "
                             f"the bucket copy is corrupt: delete bases/{name}/ to rebuild it")
        tmp.replace(dest)
        fetched += 1
    return fetched


def publish_base(store, hf_dir: Path, td_dir: Path, *, hf_id: str, hf_revision: str | None,
                 provenance: dict[str, str], name: str = BASE_NAME) -> BaseManifest:
    """Upload both directories, then the manifest, create-only (a base another box finished first wins)."""
    files: dict[str, BaseFile] = {}
    for part, root in (("hf", hf_dir), ("torch_dist", td_dir)):
        for rel in _files(root):
            if rel.endswith(".part") or rel.startswith(".cache/"):
                continue
            path = root / rel
            store.upload_file(layout.base_file_key(name, part, rel), path)
            files[f"{part}/{rel}"] = BaseFile(sha256=_sha256(path), bytes=path.stat().st_size)
    manifest = BaseManifest(name=name, hf_id=hf_id, hf_revision=hf_revision, files=files, created_at=time.time(),
                            provenance=provenance)
    try:
        store.put_if_absent(layout.base_manifest_key(name), manifest.model_dump_json(indent=2).encode())
    except PreconditionFailed:
        return read_manifest(store, name) or manifest
    return manifest


def ensure_base(store, hf_dir: Path, td_dir: Path, *, hf_id: str, fetch: Callable[[Path], str | None],
                convert: Callable[[Path, Path], None], provenance: dict[str, str] | None = None,
                name: str = BASE_NAME, parts: tuple[str, ...] = ("hf", "torch_dist")) -> str:
    """Pull the shared base's `parts` (the native engine reads the HF directory alone), or build the whole base
    (fetch -> convert) and publish it, so that a box of either engine finds it complete. Returns what happened."""
    manifest = read_manifest(store, name)
    if manifest is not None:
        if manifest.hf_id != hf_id:
            raise ValueError(f"bases/{name}/ holds {manifest.hf_id}, the recipe wants {hf_id}: use another base "
                             "name or delete the old base")
        n = pull_base(store, manifest, hf_dir, td_dir, name, parts)
        wanted = sum(rel.partition("/")[0] in parts for rel in manifest.files)
        return (f"pulled bases/{name}/{'' if len(parts) > 1 else parts[0] + '/'} ({n} of {wanted} files fetched, "
                f"revision {manifest.hf_revision})")
    revision = fetch(hf_dir)
    if not (td_dir / "latest_checkpointed_iteration.txt").is_file():
        convert(hf_dir, td_dir)
    published = publish_base(store, hf_dir, td_dir, hf_id=hf_id, hf_revision=revision, provenance=provenance or {},
                             name=name)
    return f"built and published bases/{name}/ ({len(published.files)} files, revision {revision})"


# -- wiring to the box ------------------------------------------------------------------------------------
def _git_head(path: str) -> str:
    import subprocess

    res = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return res.stdout.strip() or "unknown"


def step_install_lfm2_plugin(cfg, paths) -> str:
    """Our LFM2 modules must import in slime's Python with the job's PYTHONPATH, and the spec hook must
    build the layer spec for the recipe's model; nothing is copied into slime (the tree is on the path)."""
    import os
    import subprocess
    import sys

    hf_dir = paths.hf_dir(cfg.model.hf_id)
    code = ("import json,sys; from trainer.models import lfm2_layers, lfm2_slime; "
            f"spec = lfm2_slime.lfm2_spec(type('A', (), {{'hf_checkpoint': {hf_dir!r}}})()); "
            "print(len(spec.layer_specs))")
    env = {**os.environ, "PYTHONPATH": f"{cfg.launch.megatron_dir}:{paths.remote_dir}"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        from .steps import StepFailed

        raise StepFailed(f"install_lfm2_plugin: slime's Python cannot build the LFM2 spec:\n{res.stderr[-2000:]}")
    return f"LFM2 plugin importable; spec of {res.stdout.strip()} layers"


def step_base_model(cfg, paths, store) -> str:
    from .convert_tasks import convert_command
    from .steps import run_command

    def fetch(hf_dir: Path) -> str | None:
        from huggingface_hub import HfApi, snapshot_download

        revision = HfApi().model_info(cfg.model.hf_id).sha
        snapshot_download(repo_id=cfg.model.hf_id, revision=revision, local_dir=str(hf_dir))
        return revision

    def convert(hf_dir: Path, td_dir: Path) -> None:
        import os

        from trainer.config import REPO_ROOT

        cmd = convert_command(str(hf_dir), str(td_dir), dtype="bfloat16", overwrite=True)
        run_command("base_model", cmd, {**os.environ, "PYTHONPATH": str(REPO_ROOT)})

    import transformers

    provenance = {"transformers": transformers.__version__, "engine": cfg.train.engine}
    if cfg.train.engine == "slime":
        provenance.update(slime=_git_head(cfg.launch.slime_dir), megatron_lm=_git_head(cfg.launch.megatron_dir))
    else:  # the conversion's writer: megatron-core as installed (install_packages runs before this step)
        from importlib.metadata import PackageNotFoundError, version

        try:
            provenance["megatron_core"] = version("megatron-core")
        except PackageNotFoundError:
            provenance["megatron_core"] = "not installed"
    return ensure_base(store, Path(paths.hf_dir(cfg.model.hf_id)), Path(paths.torch_dist_dir(cfg.model.hf_id)),
                       hf_id=cfg.model.hf_id, fetch=fetch, convert=convert, provenance=provenance,
                       parts=ENGINE_PARTS[cfg.train.engine])


def psqa_box_steps(steps: list, cfg) -> list:
    """An engine's on-box steps (infra/steps.py `Step`s) for the shared base's model: download_model replaced by
    base_model (the Hub revision pinned in the bucket, on either engine; convert_model dropped, the base step
    does both) unless MODEL= names a directory of the user's own, which is used as it is and never written
    into; on slime, install_lfm2_plugin either way."""
    from worker_contract.store import open_store

    from .launch_plan import LaunchStep
    from .steps import Step

    engine, own_model = cfg.train.engine, bool(cfg.model.path)
    what = " + ".join({"hf": "HF dir", "torch_dist": "torch_dist"}[part] for part in ENGINE_PARTS[engine])
    base = Step(LaunchStep(name="base_model", where="box", gpu_only=True,
                           summary=f"pull bases/lfm25/ ({what}, sha256 checked); when absent download, convert and "
                                   "publish the whole base there, manifest last"),
                lambda b: step_base_model(b.cfg, b.paths, open_store(b.cfg.store)))
    plugin = Step(LaunchStep(name="install_lfm2_plugin", where="box", gpu_only=True,
                             summary="slime's Python imports our LFM2 modules and builds the --spec layer spec"),
                  lambda b: step_install_lfm2_plugin(b.cfg, b.paths))
    out: list = []
    for step in steps:
        if step.info.name == "download_model":
            out += ([step] if own_model else [base]) + ([plugin] if engine == "slime" else [])
        elif step.info.name != "convert_model" or own_model:
            out.append(step)
    return out
