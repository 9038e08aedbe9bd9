"""One sampled completion as every worker backend hands it to the loop (no torch, no mlx here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Completion:
    token_ids: list[int]
    """Sampled ids, EOS included when the model stopped."""
    logprobs: list[float]
    """Behaviour log-prob of each sampled id."""
    finish_reason: str
    """'stop' (EOS) or 'length' (budget hit)."""
