"""The MLX worker's policy: an mlx-lm model built from the run's config, weights only ever from the bucket.

    policy = MlxPolicy(model_dir, plane="int8g64", seed=7)
    policy.load_plane("int8g64", state)      # the reconstructor's plane tensors, as they are
    policy.sample(prompt_ids, 8, temperature=1.0, top_p=1.0, max_new_tokens=320)
More in docs/mac-worker.md (module notes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .chat import ChatPolicy
from .completion import Completion
from .mlx_weights import mlx_model_name, mlx_targets, quantized_modules, to_mlx

DTYPES = ("auto", "float32", "bfloat16")


def _mlx_config(cfg: dict) -> dict:
    """config.json as mlx-lm's ModelArgs read it. transformers 5 writes rope_theta (and Llama 3.x's
    scaling) inside `rope_parameters`, which mlx-lm does not read (it would silently use its defaults),
    and writes no LFM2 `block_dim`, which mlx-lm's lfm2 requires."""
    cfg = dict(cfg)
    params = cfg.get("rope_parameters") or {}
    if isinstance(params, Mapping) and "rope_theta" in params:
        rope_type = params.get("rope_type", "default")
        if rope_type == "llama3" and cfg.get("model_type") == "llama":
            cfg["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
        elif rope_type != "default":
            raise ValueError(f"the MLX worker supports default RoPE (and llama3 on Llama) only; config.json "
                             f"has rope_type {rope_type!r}")
        cfg["rope_theta"] = params["rope_theta"]
    if cfg.get("model_type") == "lfm2":  # transformers' LFM2 block width is hidden_size; it omits block_dim
        cfg.setdefault("block_dim", cfg["hidden_size"])
    return cfg


def build_model(model_dir: str | Path):
    """An mlx-lm model of the config in model_dir, parameters not yet loaded (lazy: nothing allocated)."""
    from mlx_lm.utils import _get_classes  # mlx-lm's own class lookup; it has no public "from config" call

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    arch = (cfg.get("architectures") or [f"{cfg.get('model_type', '?')}ForCausalLM"])[0]
    mlx_model_name(arch)  # refuse an architecture we have no weight mapping for
    cfg = _mlx_config(cfg)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    for _, m in model.named_modules():  # mlx-lm's Llama 3 RoPE keeps only its scaled frequencies
        if type(m).__name__ == "Llama3RoPE":
            m.base = float(cfg["rope_theta"])
    model.eval()
    return model, arch, cfg


def rope_bases(model) -> set[float]:
    """The RoPE bases the built model uses (checked against run.json's rope_theta)."""
    return {float(m.base) for _, m in model.named_modules() if "RoPE" in type(m).__name__ and hasattr(m, "base")}


def rope_types(model) -> set[str]:
    """The RoPE variants the built model uses: "llama3" (Llama 3.x scaling) or "default" (checked against
    run.json's rope_scaling)."""
    return {"llama3" if type(m).__name__ == "Llama3RoPE" else "default"
            for _, m in model.named_modules() if "RoPE" in type(m).__name__}


def resolve_dtype(dtype: str) -> str:
    import mlx.core as mx

    if dtype not in DTYPES:
        raise ValueError(f"MLX compute dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype == "auto":
        return "bfloat16" if mx.default_device() == mx.gpu else "float32"
    return dtype


def flat_parameters(model) -> dict:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(model.parameters()))


def load_plane_into(model, architecture: str, state: Mapping[str, np.ndarray], *, dtype: str,
                    quantized: set[str] | None = None) -> set[str]:
    """Load HF-named plane tensors into an mlx-lm model as they are; returns the quantized module paths.

    `quantized` is what an earlier load set up (None on the first: the model is then given the plane's
    quantized structure); a plane that changes it is refused. With dtype float32 the non-quantized bf16
    tensors are upcast (exact); codes, scales and biases are always kept as published."""
    import mlx.core as mx
    import mlx.nn as nn

    mapped = to_mlx(architecture, state)
    mine = quantized_modules(mapped)
    if quantized is None:
        if mine:
            nn.quantize(model, group_size=64, bits=8, class_predicate=lambda p, _m: p in mine)
    elif mine != quantized:
        raise ValueError(f"published weights changed which modules are quantized: {sorted(mine ^ quantized)[:5]}")
    held = flat_parameters(model)
    missing, unknown = sorted(set(held) - set(mapped)), sorted(set(mapped) - set(held))
    if missing or unknown:
        raise ValueError(f"published weights do not fit the MLX model: missing {missing[:5]}, unknown {unknown[:5]}")
    for name, a in mapped.items():
        if tuple(a.shape) != tuple(held[name].shape):
            raise ValueError(f"{name}: published shape {tuple(a.shape)}, MLX model shape {tuple(held[name].shape)}")
    del held
    for name, a in mapped.items():  # one tensor at a time: the old one is freed as the new one lands, so a
        x = mx.array(a)             # version switch needs one tensor of headroom, not a second model
        quant_param = name.rpartition(".")[0] in mine and name.endswith((".scales", ".biases"))
        if dtype == "float32" and x.dtype == mx.bfloat16 and not quant_param:
            x = x.astype(mx.float32)  # exact: every bf16 value is a float32 value
        mx.eval(x)
        model.load_weights([(name, x)], strict=False)
    return mine


def _writable(x) -> np.ndarray:
    """A flat numpy view of an evaluated mlx array's own buffer (bf16 seen as uint16): writing it rewrites
    the array in place, with no copy of the rest (unified memory on Apple silicon; the host on a CPU)."""
    import mlx.core as mx

    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    return np.array(x, copy=False).reshape(-1)


@dataclass
class PatchWrites:
    """What a patch writes into a loaded model, worked out from the plane alone, so that the follower's thread
    can do it while the model samples (worker/follower.py): the pause is then only the writes."""
    parts: list[tuple[str, int, np.ndarray, np.ndarray]]  # (mlx-lm name, start, positions from start, values)
    whole: dict[str, np.ndarray]  # mlx-lm name -> mapped tensor: the mapping reorders it (rewritten whole)


def plan_patch(architecture: str, state: Mapping[str, np.ndarray], changes: Mapping[str, np.ndarray],
               kinds: Mapping[str, np.dtype]) -> PatchWrites:
    """The changed elements of the plane tensors `changes` names (flat indices, from the reconstructor), read
    out of `state` and put in the bits of the model array each lands in (`kinds`: each mlx-lm name's dtype as
    its writable view sees it, bf16 as uint16). For int8g64: the changed code words and their groups' scales
    and biases, each a tensor of its own in the plane. Reads numpy only, never the model."""
    parts: list[tuple[str, int, np.ndarray, np.ndarray]] = []
    whole: dict[str, np.ndarray] = {}
    for name, idx in changes.items():
        src = np.asarray(state[name])
        targets = mlx_targets(architecture, name, src.shape, idx)
        if targets is None:  # reordered by the mapping: the whole tensor, mapped as a load maps it
            whole.update(to_mlx(architecture, {name: src}))
            continue
        flat = src.reshape(-1)
        if flat.dtype.name == "bfloat16":
            flat = flat.view(np.uint16)  # bits are what is copied: an integer gather is faster than bf16's
        for mname, start, at, take in targets:
            vals = flat[take]
            if kinds[mname] == np.float32 and vals.dtype == np.uint16:
                vals = vals.view(src.dtype).astype(np.float32)  # exact, as a full load's upcast
            parts.append((mname, start, at, vals.view(kinds[mname])))
    return PatchWrites(parts, whole)


def write_patch(model, writes: PatchWrites, views: dict[str, np.ndarray]) -> dict[str, int]:
    """Write a planned patch into the loaded model, in place: bit for bit what `load_plane_into` of the whole
    new state gives. `views` holds each array's writable view from one version to the next (the caller
    empties it when a full load replaces the arrays). Returns {"elements": rewritten, "bytes": written,
    "whole": tensors rewritten whole}."""
    import mlx.core as mx

    held = flat_parameters(model)
    mx.eval(list(held.values()))
    if hasattr(mx, "synchronize"):
        mx.synchronize()  # nothing in flight reads a buffer while it is written
    out = {"elements": 0, "bytes": 0, "whole": 0}
    for mname, a in writes.whole.items():
        x = mx.array(a).astype(held[mname].dtype)
        mx.eval(x)
        model.load_weights([(mname, x)], strict=False)
        views.pop(mname, None)  # a new array: a view of the old one would write nowhere
        out["whole"] += 1
        out["bytes"] += x.nbytes
    for mname, start, at, vals in writes.parts:  # one view a target: the stacked experts take 32 patch tensors each
        if mname not in views:
            views[mname] = _writable(held[mname])
        views[mname][start:][at] = vals
        out["elements"] += len(at)
        out["bytes"] += vals.nbytes
    return out


class MlxPolicy(ChatPolicy):
    def __init__(self, model_dir: str | Path, *, plane: str, seed: int = 0, dtype: str = "auto"):
        import mlx.core as mx

        super().__init__(model_dir)
        self.model, self.architecture, self.config = build_model(model_dir)
        self.plane = plane
        self.dtype = resolve_dtype(dtype)
        self.key = mx.random.key(seed % (2**63))
        self._quantized: set[str] | None = None
        self._views: dict[str, np.ndarray] = {}  # writable views of the model's arrays (write_patch)
        self._kinds: dict[str, np.dtype] = {}  # each array's dtype as its view sees it (plan_patch), once loaded
        from ..routes import route_shape
        from .route_recorder import MlxRouteRecorder

        shape = route_shape(self.config)  # MoE: every forward's routes are recorded (worker_contract/routes.py)
        self.recorder = None if shape is None else MlxRouteRecorder(self.model, shape)

    def load_plane(self, plane: str, state: Mapping[str, np.ndarray],
                   changes: Mapping[str, np.ndarray] | None = None) -> dict[str, int]:
        """Replace the parameters with the published ones (between groups only: the loop calls this after a
        group is uploaded): all of them (`changes` None: a join or an anchor; a missing, unknown or misshapen
        tensor is an error found before any is replaced, so the model keeps its previous weights), or only
        the elements a patch changed. Returns what was written (see `write_patch`)."""
        if changes is not None and self._kinds:
            return self.write_patch(self.prepare_patch(plane, state, changes))
        self._check_plane(plane)
        self._views.clear()  # the arrays are replaced: their views would write into the old ones
        self._quantized = load_plane_into(self.model, self.architecture, state, dtype=self.dtype,
                                          quantized=self._quantized)
        if not self._kinds:  # the same model every version: its arrays' dtypes never change
            self._kinds = {n: _writable(x).dtype for n, x in flat_parameters(self.model).items()}
        return {"elements": sum(int(np.asarray(a).size) for a in state.values()),
                "bytes": sum(int(np.asarray(a).nbytes) for a in state.values()), "whole": len(state)}

    def prepare_patch(self, plane: str, state: Mapping[str, np.ndarray],
                      changes: Mapping[str, np.ndarray]) -> PatchWrites | None:
        """What `write_patch` writes for a patch, from the plane alone: safe beside sampling, so the follower's
        thread does it. None before the first full load (nothing to patch yet)."""
        self._check_plane(plane)
        return plan_patch(self.architecture, state, changes, self._kinds) if self._kinds else None

    def write_patch(self, writes: PatchWrites) -> dict[str, int]:
        """The pause of a patch: its planned writes into the model's arrays (between groups only)."""
        return write_patch(self.model, writes, self._views)

    def _check_plane(self, plane: str) -> None:
        if plane != self.plane:
            raise ValueError(f"this policy was built for plane {self.plane!r}, not {plane!r}")

    def sample(self, prompt: list[int], n: int, *, temperature: float, top_p: float,
               max_new_tokens: int) -> list[Completion]:
        import mlx.core as mx

        from .mlx_sampling import sample_group

        self.key, key = mx.random.split(self.key)
        return sample_group(self.model, prompt, n, temperature=temperature, top_p=top_p,
                            max_new_tokens=max_new_tokens, eos_ids=self.eos_ids, key=key, recorder=self.recorder)

    def sample_many(self, prompts: list[list[int]], n: int, *, temperature: float, top_p: float,
                    max_new_tokens: int) -> list[list[Completion]]:
        """`n` completions of each prompt, one shared prefill per prompt."""
        return [self.sample(p, n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
                for p in prompts]

    def episode_engine(self, *, temperature: float, top_p: float):
        import mlx.core as mx

        from .mlx_sampling import MlxEngine

        self.key, key = mx.random.split(self.key)
        return MlxEngine(self.model, self.decode, temperature=temperature, top_p=top_p, key=key, recorder=self.recorder)
