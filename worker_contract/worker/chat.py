"""The run's tokenizer with the worker's prompt and stop rules: one definition for every worker backend.

The torch and the MLX worker must build the same prompt ids from the same messages and stop on the same
ids, or their groups would differ for reasons other than the weights. transformers' tokenizer needs no
torch, so this module imports in the MLX worker's environment too.
"""

from __future__ import annotations

import json
from pathlib import Path


class ChatTokenizer:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        eos = cfg.get("eos_token_id")
        eos = self.tokenizer.eos_token_id if eos is None else eos
        self.eos_ids: list[int] = sorted({*(eos if isinstance(eos, list) else [eos]),
                                          self.tokenizer.eos_token_id} - {None})
        """Ids that end a completion: config.json's eos_token_id(s) and the tokenizer's."""
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else self.eos_ids[0]

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        from ..tasks.base import render_prompt

        return render_prompt(self.tokenizer, messages)

    def encode(self, text: str) -> list[int]:
        """Text as ids with no special tokens added (a tool turn is tokenized on its own)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


class ChatPolicy:
    """What both workers' policies share (worker/model.py's torch one, worker/mlx_model.py's): the chat
    tokenizer and its text side (prompt ids, a tool turn's encode and decode) and the search-episode loop;
    each policy supplies its sampling engine (`episode_engine`)."""

    def __init__(self, model_dir: str | Path):
        self.chat = ChatTokenizer(model_dir)
        self.tokenizer, self.eos_ids, self.pad_id = self.chat.tokenizer, self.chat.eos_ids, self.chat.pad_id

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.chat.prompt_ids(messages)

    def encode(self, text: str) -> list[int]:
        """A tool turn's ids, tokenized on its own (no special tokens added)."""
        return self.chat.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.chat.decode(token_ids)

    def episode_engine(self, *, temperature: float, top_p: float, **options):
        """The engine worker/episodes.py samples turns with (options: the policy's own, e.g. `greedy`)."""
        raise NotImplementedError

    def sample_episodes(self, prompt: list[int], n: int, *, temperature: float, top_p: float, max_new_tokens: int,
                        search, max_turns: int = 4, batched: bool = True, **options):
        """n search episodes of one prompt, one shared prompt prefill (worker/episodes.py): (episodes, counts)."""
        groups, count = self.sample_episode_groups([prompt], n, temperature=temperature, top_p=top_p,
                                                   max_new_tokens=max_new_tokens, search=search, max_turns=max_turns,
                                                   batched=batched, **options)
        return groups[0], count

    def sample_episode_groups(self, prompts: list[list[int]], n: int, *, temperature: float, top_p: float,
                              max_new_tokens: int, search, max_turns: int = 4, batched: bool = True, **options):
        """n search episodes of each prompt, all decoding in one batch (batched=False: one sample at a time,
        the reference); each prompt prefilled once: (groups, counts)."""
        from .episodes import sample_episode_groups

        engine = self.episode_engine(temperature=temperature, top_p=top_p, **options)
        return sample_episode_groups(engine, self.eos_ids, prompts, n, encode=self.encode, search=search,
                                     max_new_tokens=max_new_tokens, max_turns=max_turns, batched=batched)
