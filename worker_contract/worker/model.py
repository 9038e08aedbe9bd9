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

from ..tensors import sorted_positions, to_torch
from .chat import ChatPolicy
from .sampling import Completion, sample


def _no_init_weights():
    """transformers' switch that skips the weights' random init (its module moved in transformers 5)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


class PolicyModel(ChatPolicy):
    def __init__(self, model_dir: str | Path, *, threads: int | None = None, seed: int = 0,
                 device: str | None = None, record_routes: bool = True):
        from transformers import AutoConfig, AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if self.device.type == "cuda":
            # cuDNN's attention builds a graph for each new key length, and decoding makes a new one every
            # token: on an H100 each attention call blocked the host about 30 ms (half of the torch worker's
            # sampling time, bench/results/worker_speed_decode_cuda_h100_*). Flash and memory-efficient
            # attention serve the same shapes without a per-shape build.
            torch.backends.cuda.enable_cudnn_sdp(False)
        super().__init__(model_dir)
        config = AutoConfig.from_pretrained(str(model_dir))
        # no random init: `load` overwrites every parameter and persistent buffer before the first sample (a
        # missing one is an error there), and the non-persistent ones (RoPE's) are computed, not initialised.
        # The init's cost grows with the model: 15 s on 2 cores for 0.56 B of LFM2-MoE, against none
        with _no_init_weights():
            self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        self.model.tie_weights()  # tying is part of the init skipped above: a tied head would stay its own tensor
        self.model = self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        from ..routes import route_shape
        from .route_recorder import TorchRouteRecorder

        # MoE: every forward's routes are recorded (worker_contract/routes.py) and taken by the sampler; a model
        # that only scores (a held-out evaluation, `record_routes=False`) has no one to take them: none are kept
        shape = route_shape(config.to_dict()) if record_routes else None
        self.recorder = None if shape is None else TorchRouteRecorder(self.model, shape)
        self._dtypes: dict[str, torch.dtype] = {}  # each parameter's and buffer's, once loaded (prepare_patch)

    def load_plane(self, plane: str, state: Mapping[str, np.ndarray],
                   changes: Mapping[str, np.ndarray] | None = None) -> dict[str, int]:
        """A state in the run's plane: all of it (`changes` None: a join or an anchor; dequantized to HF-named
        dense tensors first for int8g64), or only the elements a patch changed (see `prepare_patch`)."""
        from ..planes import get_plane

        if changes is not None and self._dtypes:
            return self.write_patch(self.prepare_patch(plane, state, changes))
        self.load(get_plane(plane).to_dense(state))
        self._dtypes = {n: t.dtype for n, t in self.model.state_dict().items()}  # the same every version
        return {"elements": sum(p.numel() for p in self.model.parameters()),
                "bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()), "whole": -1}

    @torch.no_grad()
    def prepare_patch(self, plane: str, state: Mapping[str, np.ndarray],
                      changes: Mapping[str, np.ndarray]) -> list[tuple[str, torch.Tensor, torch.Tensor]] | None:
        """What `write_patch` writes for a patch, from the plane alone (safe beside sampling, so the follower's
        thread does it): a dense tensor's changed elements; for an int8g64 module, each group of 64 whose
        codes, scale or bias changed, dequantized alone (the dequantization is per group, so this is bit for
        bit the whole tensor's). A list of (parameter, rows, values): rows of 1 element or of a group, on the
        host, in the parameter's dtype. None before the first full load."""
        from ..planes import int8g64

        if not self._dtypes:
            return None
        mods = set(int8g64.quantized_modules(state)) if plane == int8g64.NAME else set()
        groups: dict[str, np.ndarray] = {}
        writes = []
        for name, idx in changes.items():
            mod, _, leaf = name.rpartition(".")
            if mod in mods:  # codes: 16 uint32 words (64 codes) a group; scales and biases: one a group
                g = idx // (int8g64.GROUP_SIZE // 4) if leaf == "weight" else idx
                groups[mod] = sorted_positions(*([groups[mod]] if mod in groups else []), g,
                                               size=np.asarray(state[f"{mod}.scales"]).size)
                continue
            if name not in self._dtypes:
                continue  # a tied lm_head, RoPE's inv_freq: as `load` skips them
            vals = to_torch(np.ascontiguousarray(np.asarray(state[name]).reshape(-1)[idx]))
            writes.append((name, torch.from_numpy(idx), vals.to(self._dtypes[name]).reshape(-1, 1)))
        for mod, g in groups.items():
            codes = np.asarray(state[f"{mod}.weight"]).reshape(-1, int8g64.GROUP_SIZE // 4)[g]
            scales = np.asarray(state[f"{mod}.scales"]).reshape(-1, 1)[g]
            biases = np.asarray(state[f"{mod}.biases"]).reshape(-1, 1)[g]
            dense = to_torch(np.ascontiguousarray(int8g64.dequantize_np(codes, scales, biases)))
            writes.append((f"{mod}.weight", torch.from_numpy(g), dense.to(self._dtypes[f"{mod}.weight"])))
        return writes

    @torch.no_grad()
    def write_patch(self, writes: list[tuple[str, torch.Tensor, torch.Tensor]]) -> dict[str, int]:
        """The pause of a patch: its planned rows written into the model in place (between groups only).
        Returns {"elements", "bytes", "whole": 0}."""
        held = self.model.state_dict(keep_vars=True)
        out = {"elements": 0, "bytes": 0, "whole": 0}
        for name, rows, vals in writes:
            dst = held[name].data.view(-1, vals.shape[1])
            dst[rows.to(dst.device)] = vals.to(dst.device)
            out["elements"] += vals.numel()
            out["bytes"] += vals.numel() * vals.element_size()
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
