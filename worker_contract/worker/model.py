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
from .chat import ChatTokenizer
from .sampling import Completion, sample


class PolicyModel:
    def __init__(self, model_dir: str | Path, *, threads: int | None = None, seed: int = 0,
                 device: str | None = None):
        from transformers import AutoConfig, AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.chat = ChatTokenizer(model_dir)
        self.tokenizer, self.eos_ids, self.pad_id = self.chat.tokenizer, self.chat.eos_ids, self.chat.pad_id
        config = AutoConfig.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def load_plane(self, plane: str, state: Mapping[str, np.ndarray]) -> None:
        """A full state in the run's plane: dequantized to HF-named dense tensors first (int8g64)."""
        from ..planes import get_plane

        self.load(get_plane(plane).to_dense(state))

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

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.chat.prompt_ids(messages)

    def sample(self, prompt: list[int], n: int, *, temperature: float, top_p: float,
               max_new_tokens: int) -> list[Completion]:
        return sample(self.model, [prompt] * n, temperature=temperature, top_p=top_p,
                      max_new_tokens=max_new_tokens, eos_ids=self.eos_ids, pad_id=self.pad_id,
                      generator=self.generator)

    def sample_many(self, prompts: list[list[int]], n: int, *, temperature: float, top_p: float,
                    max_new_tokens: int) -> list[list[Completion]]:
        """`n` completions of each prompt, all rows in one batch; one list per prompt."""
        flat = sample(self.model, [p for p in prompts for _ in range(n)], temperature=temperature, top_p=top_p,
                      max_new_tokens=max_new_tokens, eos_ids=self.eos_ids, pad_id=self.pad_id,
                      generator=self.generator)
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]

    def sample_episodes(self, prompt: list[int], n: int, *, temperature: float, top_p: float, max_new_tokens: int,
                        search, max_turns: int = 4, greedy: bool = False, batched: bool = True):
        """n search episodes of one prompt, one shared prompt prefill (worker/episodes.py): (episodes, counts)."""
        groups, count = self.sample_episode_groups([prompt], n, temperature=temperature, top_p=top_p,
                                                   max_new_tokens=max_new_tokens, search=search, max_turns=max_turns,
                                                   greedy=greedy, batched=batched)
        return groups[0], count

    def sample_episode_groups(self, prompts: list[list[int]], n: int, *, temperature: float, top_p: float,
                              max_new_tokens: int, search, max_turns: int = 4, greedy: bool = False,
                              batched: bool = True):
        """n search episodes of each prompt, all decoding in one batch (batched=False: one sample at a time,
        the reference); each prompt prefilled once: (groups, counts)."""
        from .episodes import sample_episode_groups
        from .sampling import TorchEngine

        engine = TorchEngine(self.model, self.decode, temperature=temperature, top_p=top_p, greedy=greedy,
                             generator=self.generator)
        return sample_episode_groups(engine, self.eos_ids, prompts, n, encode=self.encode, search=search,
                                     max_new_tokens=max_new_tokens, max_turns=max_turns, batched=batched)

    def encode(self, text: str) -> list[int]:
        """A tool turn's ids, tokenized on its own (no special tokens added)."""
        return self.chat.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.chat.decode(token_ids)
