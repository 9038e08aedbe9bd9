"""Routing replay: the learner's MoE layers send each token to the experts the worker routed it to.

    replay = Replayer.hf(model, shape)            # or Replayer.megatron(model, shape)
    with replay.routes(mb.routes):                # [b, t, layers, top_k], -1 = route as the learner would
        logp = forward(mb); loss.backward()       # the backward's recomputation replays the same routes

Gating weights stay the learner's (its sigmoid scores at the recorded experts), so the router keeps
learning. hf: a forward hook on each router; megatron: our router through megatron-core's replay entry.
More in docs/objective.md (module notes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from worker_contract.routes import RouteShape


def merged_topk(own: torch.Tensor, recorded: torch.Tensor | None) -> torch.Tensor:
    """[N, k] int64 expert ids: `recorded` where a row has one (ids >= 0), `own` elsewhere."""
    if recorded is None:
        return own
    rec = recorded.to(device=own.device, dtype=torch.long)
    return torch.where(rec[:, :1] >= 0, rec.clamp(min=0), own)


class Replayer:
    """The routes of the micro-batch in hand, laid out per MoE layer as each backend's routers see tokens."""

    def __init__(self, shape: RouteShape, sites: int, seq_first: bool):
        if sites != shape.layers:
            raise ValueError(f"the model has {sites} routed MoE layers, the route shape {shape.layers}")
        self.shape, self.seq_first = shape, seq_first
        self._layers: list[torch.Tensor] | None = None

    @classmethod
    def hf(cls, model: torch.nn.Module, shape: RouteShape) -> Replayer:
        """Hooks on the routers of a transformers LFM2-MoE model (tokens batch-major: row b*T + t)."""
        routers = [m for m in model.modules() if type(m).__name__ == "Lfm2MoeTopKRouter"]
        self = cls(shape, len(routers), seq_first=False)
        for pos, router in enumerate(routers):
            router.register_forward_hook(self._hf_hook(pos))
        return self

    @classmethod
    def megatron(cls, model: torch.nn.Module, shape: RouteShape) -> Replayer:
        """Our megatron routers (lfm2_layers.FrozenBiasRouter, which declares `replay_source`; tokens
        sequence-major: row t*B + b)."""
        routers = [m for m in model.modules() if hasattr(type(m), "replay_source")]
        self = cls(shape, len(routers), seq_first=True)
        for pos, router in enumerate(routers):
            router.replay_source = (self, pos)
        return self

    def layer(self, pos: int) -> torch.Tensor | None:
        """[N, top_k] recorded ids of MoE layer `pos` for the forward in progress, or None (no replay)."""
        return None if self._layers is None else self._layers[pos]

    @contextlib.contextmanager
    def routes(self, routes: torch.Tensor | None) -> Iterator[None]:
        """Replay `routes` [b, t, layers, top_k] in every forward (and recomputation) inside the block."""
        if routes is None:
            yield
            return
        if tuple(routes.shape[2:]) != (self.shape.layers, self.shape.top_k):
            raise ValueError(f"routes of shape {tuple(routes.shape)}; the model routes {self.shape.layers} layers "
                             f"x top {self.shape.top_k}")
        r = routes.transpose(0, 1) if self.seq_first else routes
        k = self.shape.top_k
        self._layers = [r[:, :, pos].reshape(-1, k) for pos in range(self.shape.layers)]
        try:
            yield
        finally:
            self._layers = None

    def _hf_hook(self, pos: int):
        def hook(router: Any, args: tuple, output: tuple) -> tuple | None:
            recorded = self.layer(pos)
            if recorded is None:
                return None
            logits, _, own = output
            if recorded.shape[0] != own.shape[0]:
                raise ValueError(f"MoE layer {pos}: {own.shape[0]} tokens in the forward, {recorded.shape[0]} routed")
            idx = merged_topk(own, recorded)
            weights = torch.gather(logits.sigmoid(), 1, idx).type_as(logits)
            if router.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
            return logits, weights * router.routed_scaling_factor, idx

        return hook


class MegatronReplay:
    """megatron-core's replay entry of `topk_routing_with_score_function` (its `router_replay` argument):
    the recorded experts where there are some, the default top-k elsewhere; probabilities gathered from the
    scores it is handed (sigmoid, without the expert bias, where the model has one)."""

    def __init__(self, recorded: torch.Tensor):
        self.recorded = recorded

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Any = None):
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.recorded.shape[0] != scores.shape[0]:
            raise ValueError(f"{scores.shape[0]} tokens in the forward, {self.recorded.shape[0]} routed")
        idx = merged_topk(own, self.recorded)
        return scores.gather(1, idx), idx
