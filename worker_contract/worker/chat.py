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
