"""Reading and writing Hugging Face checkpoint directories (config.json + safetensors), with clear errors.

Only the HF file layout lives here; name mapping is per architecture (registry.py and its modules).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: config.json fields every decoder we convert must have
REQUIRED_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads")


class ConvertError(ValueError):
    """A checkpoint directory or config cannot be converted; the message says which file/field and the fix."""


def load_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """config.json as a dict, with the fields conversion needs checked to be present and well typed."""
    d = Path(hf_dir)
    if not d.is_dir():
        raise ConvertError(f"HF checkpoint directory {d} does not exist; pass the directory holding config.json")
    path = d / CONFIG_FILE
    if not path.is_file():
        raise ConvertError(f"{path} is missing: an HF checkpoint directory needs config.json beside its safetensors")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConvertError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    missing = [f for f in REQUIRED_FIELDS if f not in cfg]
    if missing:
        raise ConvertError(f"{path} lacks required field(s) {', '.join(missing)}; is this a decoder LM config?")
    for f in REQUIRED_FIELDS[1:] + ("num_key_value_heads", "head_dim"):
        v = cfg.get(f)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConvertError(f"{path}: {f}={v!r} must be a positive integer")
    rope_theta_of(cfg, source=str(path))  # validates presence and type
    return cfg


#: the fields of llama3 rope scaling (Llama 3.1 / 3.2 / 3.3), all required, as transformers reads them
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_params(cfg: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ConvertError(f"{source}: rope_parameters={params!r} must be an object")
    return params


def rope_scaling_of(cfg: Mapping[str, Any], source: str = "config.json") -> dict[str, Any] | None:
    """None for plain RoPE; for Llama 3.x scaling {"rope_type": "llama3", factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings} (`rope_parameters` in transformers 5,
    `rope_scaling` in 4.x). Any other rope type is refused."""
    params = _rope_params(cfg, source)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ConvertError(f"{source}: rope_type={rope_type!r} is not supported (plain RoPE or llama3 only); "
                           "convert a model with one of those")
    out: dict[str, Any] = {"rope_type": "llama3"}
    for f in LLAMA3_FIELDS:
        v = params.get(f)
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise ConvertError(f"{source}: llama3 rope scaling needs a positive number for {f}, got {v!r}")
        out[f] = int(v) if f == "original_max_position_embeddings" else float(v)
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ConvertError(f"{source}: llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                           f"{out['high_freq_factor']} <= {out['low_freq_factor']}")
    return out


def rope_theta_of(cfg: Mapping[str, Any], source: str = "config.json") -> float:
    """The rotary base: `rope_parameters.rope_theta` (transformers 5) or top-level `rope_theta` (4.x); the
    rope type must be one we build (rope_scaling_of)."""
    params = _rope_params(cfg, source)
    rope_scaling_of(cfg, source)
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ConvertError(f"{source} has no rope_theta (neither top level nor in rope_parameters)")
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise ConvertError(f"{source}: rope_theta={theta!r} must be a positive number")
    return float(theta)


def refuse_unsupported(cfg: Mapping[str, Any], checks: list[tuple[bool, str]], *, rope_scaling: bool = False) -> None:
    """Every failed (ok, why) check in one ConvertError, then the rotary base must be readable; rope
    scaling only where the architecture builds it (`rope_scaling`)."""
    scaling = rope_scaling_of(cfg)
    checks = [*checks, (rope_scaling or scaling is None, f"rope_type={(scaling or {}).get('rope_type')!r} (plain RoPE only)")]
    bad = [why for ok, why in checks if not ok]
    if bad:
        raise ConvertError(f"config.json (model_type {cfg.get('model_type')}) has unsupported settings: {'; '.join(bad)}")
    rope_theta_of(cfg)


def safetensors_files(hf_dir: str | Path) -> list[Path]:
    """The weight shards: model.safetensors, or every file the index names (each checked to exist)."""
    d = Path(hf_dir)
    single, index = d / SINGLE_FILE, d / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConvertError(f"{index} is malformed ({e!r}); it must hold a 'weight_map' object") from None
        files = sorted({d / name for name in weight_map.values()})
    elif single.is_file():
        files = [single]
    else:
        raise ConvertError(
            f"no weights in {d}: expected {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are converted)"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConvertError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
    return files


def iter_tensors(files: list[Path], advance: Callable[[int], None] | None = None) -> Iterator[tuple[str, Any]]:
    """(name, torch tensor) for every tensor in the shards; `advance(nbytes)` is called after each one read
    (a `trainer.progress.progress` bar in bytes, totalling the shards' sizes)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                if advance is not None:
                    advance(t.numel() * t.element_size())
                yield name, t


def save_hf_state(state: Mapping[str, Any], out_dir: str | Path, config: Mapping[str, Any],
                  max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write `state` as HF safetensors (sharded with an index above `max_shard_bytes`) plus config.json."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name in sorted(state):
        t = state[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    paths: list[Path] = []
    if len(shards) == 1:
        paths.append(out / SINGLE_FILE)
        save_file(shards[0], str(paths[0]), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            p = out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(p), metadata={"format": "pt"})
            paths.append(p)
            weight_map.update({n: p.name for n in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    return paths
