"""HF checkpoint -> Megatron torch_dist checkpoint (and back), with the model-identity gate in front.

Order of work: read config.json and the tokenizer, check identity (a differing rotary base is refused
before anything is read), find the shards, then read -> map -> load into a GPTModel -> save through
megatron's dist_checkpointing -> reload and compare (verify). `model_identity.json` and finally the
tracker file are written only after the tensors: an interrupted conversion leaves no loadable checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from trainer.models import torch_dist
from trainer.models.hf_io import ConvertError, iter_tensors, load_hf_config, safetensors_files, save_hf_state
from trainer.models.identity import (
    IDENTITY_FILE,
    ModelIdentity,
    check_model_identity,
    identity_from_hf,
    read_identity,
)
from trainer.models.registry import get_architecture
from trainer.progress import progress as progress_bar
from trainer.progress import stage

_DTYPES = {"bfloat16", "float16", "float32"}
#: tokenizer and generation files copied verbatim when exporting back to HF
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "generation_config.json")


def plan(hf_dir: str | Path, out_dir: str | Path, *, rotary_base: float | None = None,
         padded_vocab_size: int | None = None, dtype: str | None = None) -> dict[str, Any]:
    """Everything that can be checked without megatron or reading tensors: config, identity, shards."""
    cfg = load_hf_config(hf_dir)
    get_architecture(cfg).validate(cfg)
    identity = identity_from_hf(hf_dir, padded_vocab_size=padded_vocab_size)
    check_model_identity(identity, rotary_base=rotary_base)
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {', '.join(sorted(_DTYPES))} (or omit it to keep the stored dtype)")
    files = safetensors_files(hf_dir)
    out = Path(out_dir)
    return {
        "hf_dir": str(Path(hf_dir).resolve()),
        "out_dir": str(out.resolve()),
        "checkpoint_dir": str(torch_dist.iteration_dir(out).resolve()),
        "tracker": str((out / torch_dist.TRACKER).resolve()),
        "shards": [f.name for f in files],
        "bytes": sum(f.stat().st_size for f in files),
        "dtype": dtype or "as stored",
        "identity": identity.model_dump(mode="json"),
    }


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConvertError(f"{out} is not empty; choose a fresh --out, or pass --overwrite to replace a checkpoint")
        # a converted checkpoint, or what a conversion killed part-way left: its iteration directory alone
        left_by_a_kill = [p.name for p in out.iterdir()] == [torch_dist.iteration_dir(out).name]
        if not (out / IDENTITY_FILE).exists() and not (out / torch_dist.TRACKER).exists() and not left_by_a_kill:
            raise ConvertError(f"{out} does not look like a converted checkpoint; refusing to overwrite it")
        for name in (torch_dist.TRACKER, IDENTITY_FILE):
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(torch_dist.iteration_dir(out), ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def convert(hf_dir: str | Path, out_dir: str | Path, *, rotary_base: float | None = None,
            padded_vocab_size: int | None = None, dtype: str | None = None, overwrite: bool = False,
            verify: bool = True, progress: bool = True) -> ModelIdentity:
    """Convert and return the recorded identity. Run under `if __name__ == "__main__"`: the writer spawns."""
    info = plan(hf_dir, out_dir, rotary_base=rotary_base, padded_vocab_size=padded_vocab_size, dtype=dtype)
    identity = ModelIdentity.model_validate(info["identity"])
    cfg = load_hf_config(hf_dir)
    arch = get_architecture(cfg)
    out = Path(out_dir)
    fresh_out = not out.exists()
    _prepare_out(out, overwrite)
    try:
        _write(hf_dir, out, cfg, arch, identity, info, dtype=dtype, verify=verify, progress=progress)
    except BaseException:  # a failed or interrupted conversion leaves no partial checkpoint: a retry just runs
        shutil.rmtree(torch_dist.iteration_dir(out), ignore_errors=True)
        (out / IDENTITY_FILE).unlink(missing_ok=True)  # written just before the tracker: only this call's
        if fresh_out and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    return identity


def _write(hf_dir, out: Path, cfg, arch, identity: ModelIdentity, info: dict, *, dtype: str | None, verify: bool,
           progress: bool) -> None:
    """Read the HF shards, save them as torch_dist under `out`, verify the reload; the identity and tracker last."""
    import torch  # after the checks above: a wrong directory or flag is told before seconds of imports

    with progress_bar("reading safetensors", total=info["bytes"], unit="bytes", show=progress) as advance:
        hf = dict(iter_tensors(safetensors_files(hf_dir), advance))
    stored = {t.dtype for t in hf.values()}
    target = getattr(torch, dtype) if dtype else (stored.pop() if len(stored) == 1 else torch.float32)
    hf = {k: v.to(target) for k, v in hf.items()}
    with stage("mapping to Megatron names", show=progress):
        mg = arch.hf_to_megatron(hf, cfg, identity.padded_vocab_size)
        del hf
    from trainer.models.model import build_model, full_state, load_full_state

    with torch_dist.single_process_group():
        with stage("building GPTModel and saving torch_dist", show=progress):
            model = build_model(cfg, padded_vocab_size=identity.padded_vocab_size, dtype=target,
                                attention="local", fused=False, device="cpu")
            load_full_state(model, mg)
            ckpt = torch_dist.save(model, out, tracker=False)
        if verify:
            with stage("verifying (reload and compare)", show=progress):
                fresh = build_model(cfg, padded_vocab_size=identity.padded_vocab_size, dtype=target,
                                    attention="local", fused=False, device="cpu")
                torch_dist.load(fresh, out, directory=ckpt)
                back = full_state(fresh)
                bad = [k for k, v in mg.items() if not torch.equal(back[k], v)]
                if bad:
                    raise ConvertError(f"verification failed: {len(bad)} tensor(s) differ after reload, e.g. {bad[:4]}")
    identity.write(out)
    torch_dist.write_tracker(out)  # last: marks the checkpoint complete


def export_hf(ckpt_root: str | Path, out_dir: str | Path, *, hf_source: str | Path,
              progress: bool = True) -> list[Path]:
    """Megatron torch_dist checkpoint -> HF safetensors (+ config and tokenizer files from `hf_source`).

    The identity recorded beside the checkpoint must match `hf_source` (the model the workers run).
    """
    cfg = load_hf_config(hf_source)
    recorded = read_identity(ckpt_root)
    check_model_identity(identity_from_hf(hf_source, padded_vocab_size=recorded.padded_vocab_size), checkpoint=recorded)
    arch = get_architecture(cfg)
    import torch  # after the checks above, as in convert

    from trainer.models.model import build_model, full_state

    with torch_dist.single_process_group():
        with stage("loading torch_dist", show=progress):
            model = build_model(cfg, padded_vocab_size=recorded.padded_vocab_size, dtype=torch.float32,
                                attention="local", fused=False, device="cpu")
            d = torch_dist.checkpoint_dir(ckpt_root)
            from megatron.core import dist_checkpointing

            # keep the stored dtype: load into a model of that dtype (read it from the first tensor)
            meta = dist_checkpointing.load_tensors_metadata(str(d))
            dtypes = {m.dtype for m in meta.values() if hasattr(m, "dtype")}
            if len(dtypes) == 1:
                model = model.to(dtypes.pop())
            torch_dist.load(model, ckpt_root)
        state = arch.megatron_to_hf(full_state(model), cfg)
    paths = save_hf_state(state, out_dir, cfg)
    for name in TOKENIZER_FILES:
        src = Path(hf_source) / name
        if src.is_file():
            shutil.copy2(src, Path(out_dir) / name)
    return paths
