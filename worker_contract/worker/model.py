"""The worker's policy: an HF causal LM built from the run's config, weights only ever from the bucket.

The local directory supplies config.json and the tokenizer (checked against run.json first); its
weights, if any, are never read. Published weights arrive as HF-named numpy arrays (bf16 plane: bf16;
int8g64: dequantized) and are copied into the model in place, upcast to float32 on CPU, which is exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from ..tensors import to_torch
from .chat import ChatPolicy
from .sampling import Completion, sample


class PolicyModel(ChatPolicy):
    def __init__(self, model_dir: str | Path, *, threads: int | None = None, seed: int = 0,
                 device: str | None = None):
        from transformers import AutoConfig, AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        super().__init__(model_dir)
        config = AutoConfig.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        from ..routes import route_shape
        from .route_recorder import TorchRouteRecorder

        shape = route_shape(config.to_dict())  # MoE: every forward's routes are recorded (worker_contract/routes.py)
        self.recorder = None if shape is None else TorchRouteRecorder(self.model, shape)
        self._loaded = False

    def load_plane(self, plane: str, state: Mapping[str, np.ndarray],
                   changes: Mapping[str, np.ndarray] | None = None) -> dict[str, int]:
        """A state in the run's plane: all of it (`changes` None: a join or an anchor; dequantized to HF-named
        dense tensors first for int8g64), or only the elements a patch changed (see `patch`)."""
        from ..planes import get_plane

        if changes is not None and self._loaded:
            return self.patch(plane, state, changes)
        self.load(get_plane(plane).to_dense(state))
        self._loaded = True
        return {"elements": sum(p.numel() for p in self.model.parameters()),
                "bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()), "whole": -1}

    @torch.no_grad()
    def patch(self, plane: str, state: Mapping[str, np.ndarray], changes: Mapping[str, np.ndarray]) -> dict[str, int]:
        """Rewrite only what a patch changed, in place: a dense tensor's changed elements; for an int8g64
        module, each group of 64 whose codes, scale or bias changed, dequantized alone (the dequantization is
        per group, so this is bit for bit the whole tensor's). Returns {"elements", "bytes", "whole": 0}."""
        from ..planes import int8g64

        params = dict(self.model.named_parameters())
        persistent = set(self.model.state_dict())
        params.update({n: b for n, b in self.model.named_buffers() if n in persistent})
        mods = set(int8g64.quantized_modules(state)) if plane == int8g64.NAME else set()
        groups: dict[str, np.ndarray] = {}
        out = {"elements": 0, "bytes": 0, "whole": 0}
        for name, idx in changes.items():
            mod, _, leaf = name.rpartition(".")
            if mod in mods:  # codes: 16 uint32 words (64 codes) a group; scales and biases: one a group
                g = idx // (int8g64.GROUP_SIZE // 4) if leaf == "weight" else idx
                groups[mod] = np.union1d(groups[mod], g) if mod in groups else g
                continue
            if name not in params:
                continue  # a tied lm_head, RoPE's inv_freq: as `load` skips them
            vals = to_torch(np.ascontiguousarray(np.asarray(state[name]).reshape(-1)[idx]))
            flat = params[name].view(-1)
            flat[torch.from_numpy(idx).to(flat.device)] = vals.to(device=flat.device, dtype=flat.dtype)
            out["elements"] += len(idx)
            out["bytes"] += len(idx) * flat.element_size()
        for mod, g in groups.items():
            codes = np.asarray(state[f"{mod}.weight"]).reshape(-1, int8g64.GROUP_SIZE // 4)[g]
            scales = np.asarray(state[f"{mod}.scales"]).reshape(-1, 1)[g]
            biases = np.asarray(state[f"{mod}.biases"]).reshape(-1, 1)[g]
            dense = to_torch(np.ascontiguousarray(int8g64.dequantize_np(codes, scales, biases)))
            w = params[f"{mod}.weight"].view(-1, int8g64.GROUP_SIZE)
            w[torch.from_numpy(g).to(w.device)] = dense.to(device=w.device, dtype=w.dtype)
            out["elements"] += dense.numel()
            out["bytes"] += dense.numel() * w.element_size()
        return out

    @torch.no_grad()
    def load(self, state: Mapping[str, np.ndarray]) -> None:
        """Copy a full published state into the model; a missing or unknown tensor is an error."""
        params = dict(self.model.named_parameters())
        persistent = set(self.model.state_dict())  # not RoPE's inv_freq (rotary_emb, LFM2-MoE's pos_emb)
        params.update({n: b for n, b in self.model.named_buffers() if n in persistent})
        tied_ok = {"lm_head.weight"} if self.tied else set()
        missing = {n for n in params if n not in state and n not in tied_ok and "rotary_emb" not in n}
        unknown = set(state) - set(params)
        if missing or unknown:
            raise ValueError(f"published weights do not fit the model: missing {sorted(missing)[:5]}, "
                             f"unknown {sorted(unknown)[:5]}")
        for name, arr in state.items():
            t = to_torch(np.asarray(arr))
            if tuple(t.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: published shape {tuple(t.shape)}, model shape {tuple(params[name].shape)}")
            params[name].copy_(t.to(params[name].dtype))

    def sample(self, prompt: list[int], n: int, *, temperature: float, top_p: float,
               max_new_tokens: int) -> list[Completion]:
        return sample(self.model, [prompt] * n, temperature=temperature, top_p=top_p,
                      max_new_tokens=max_new_tokens, eos_ids=self.eos_ids, pad_id=self.pad_id,
                      generator=self.generator, recorder=self.recorder)

    def sample_many(self, prompts: list[list[int]], n: int, *, temperature: float, top_p: float,
                    max_new_tokens: int) -> list[list[Completion]]:
        """`n` completions of each prompt, all rows in one batch; one list per prompt."""
        flat = sample(self.model, [p for p in prompts for _ in range(n)], temperature=temperature, top_p=top_p,
                      max_new_tokens=max_new_tokens, eos_ids=self.eos_ids, pad_id=self.pad_id,
                      generator=self.generator, recorder=self.recorder)
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]

    def episode_engine(self, *, temperature: float, top_p: float, greedy: bool = False):
        from .sampling import TorchEngine

        return TorchEngine(self.model, self.decode, temperature=temperature, top_p=top_p, greedy=greedy,
                           generator=self.generator, recorder=self.recorder)
