"""One sampled completion as every worker backend hands it to the loop (no torch, no mlx here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Completion:
    token_ids: list[int]
    """Sampled ids, EOS included when the model stopped."""
    logprobs: list[float]
    """Behaviour log-prob of each sampled id."""
    finish_reason: str
    """'stop' (EOS) or 'length' (budget hit)."""
    routes: Any = None
    """MoE models: uint8 [len(token_ids) - 1, layers, top_k], the experts each sampled token but the last was
    routed to when it was fed (worker/route_recorder.py); None for a dense model."""
    prompt_routes: Any = None
    """MoE models: uint8 [prompt tokens, layers, top_k], the prompt's routes in this sample's prefill."""
