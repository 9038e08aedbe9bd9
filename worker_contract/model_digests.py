"""The tokenizer and chat-template digests of run.json: one definition for the trainer and every worker.

Both are sha256 of a canonical form, so whitespace or key order in a model directory's files never makes two
copies of the same tokenizer look different. Errors are plain `ValueError`s (a missing tokenizer.json too);
callers turn them into their own kind (a conversion error, a contract mismatch).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def sha256_tagged(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def tokenizer_digest(model_dir: str | Path) -> str:
    """sha256 over tokenizer.json re-serialised canonically (sorted keys, compact)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{path} is missing: the tokenizer is part of the model's identity")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-download the tokenizer") from None
    return sha256_tagged(_canonical(data))


def chat_template_text(model_dir: str | Path) -> str:
    """The chat template as transformers stores it: chat_template.jinja, else tokenizer_config.json."""
    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        try:
            tpl = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg} is not valid JSON ({e})") from None
        if isinstance(tpl, str):
            return tpl
        if tpl is not None:  # a list of named templates
            return _canonical(tpl).decode()
    return ""


def chat_template_digest(model_dir: str | Path) -> str:
    """sha256 of the chat template text ('' hashed when there is none)."""
    return sha256_tagged(chat_template_text(model_dir).encode("utf-8"))
