"""What the workers' MoE routers chose: hooks on the model's routing, whatever decode path calls the model.

    rec = TorchRouteRecorder(model, shape)   # or MlxRouteRecorder(model, shape)
    model(ids)                                # any forward: prefill, a decode step, a batch of rows
    rec.take()                                # uint8 [rows, tokens, layers, top_k] of the forwards since the last take
    rec.clear()                               # a sampler starts here: what other forwards recorded is dropped

torch: a forward hook on each transformers LFM2-MoE router; MLX: a recording subclass of mlx-lm's expert
stack (parameters and names unchanged). The decode paths map rows and tokens to samples.
More in docs/contract.md (module notes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..routes import RouteShape


class TorchRouteRecorder:
    """Hooks on a transformers LFM2-MoE model's routers (see the module docstring)."""

    def __init__(self, model: Any, shape: RouteShape):
        blocks = [m for m in model.modules() if type(m).__name__ == "Lfm2MoeSparseMoeBlock"]
        if len(blocks) != shape.layers:
            raise ValueError(f"the model has {len(blocks)} MoE blocks, its config {shape.layers} MoE layers")
        self.shape = shape
        self._ids: list[list[Any]] = [[] for _ in blocks]
        self._rows: list[tuple[int, int]] = []
        for pos, block in enumerate(blocks):
            if pos == 0:
                block.register_forward_pre_hook(self._shape_hook)
            block.gate.register_forward_hook(self._gate_hook(pos))

    def _shape_hook(self, block: Any, args: tuple) -> None:
        self._rows.append(tuple(args[0].shape[:2]))

    def _gate_hook(self, pos: int):
        def hook(router: Any, args: tuple, output: tuple) -> None:
            self._ids[pos].append(output[2].detach())
        return hook

    def clear(self) -> None:
        """Forget what forwards outside a sampler (an evaluation, a test's own forward) recorded."""
        self._rows, self._ids = [], [[] for _ in self._ids]

    def take(self) -> np.ndarray:
        """uint8 [rows, tokens, layers, top_k] of every forward since the last take (then forgotten)."""
        import torch

        shapes, self._rows = self._rows, []
        ids, self._ids = self._ids, [[] for _ in self._ids]
        if not shapes:
            raise AssertionError("take() with no forward since the last one")
        rows = shapes[0][0]
        assert all(r == rows for r, _ in shapes) and all(len(layer) == len(shapes) for layer in ids), \
            "forwards of different rows between two takes"
        per_call = []
        for i, (_, tokens) in enumerate(shapes):
            stacked = torch.stack([layer[i] for layer in ids], dim=1)  # [rows*tokens, layers, k]
            per_call.append(stacked.reshape(rows, tokens, self.shape.layers, -1))
        out = torch.cat(per_call, dim=1).sort(dim=-1).values
        return out.to("cpu", torch.uint8).numpy()


class MlxRouteRecorder:
    """The same record for an mlx-lm LFM2-MoE model (see the module docstring)."""

    def __init__(self, model: Any, shape: RouteShape):
        blocks = [layer.feed_forward for layer in model.model.layers
                  if type(layer.feed_forward).__name__ == "Lfm2MoeSparseMoeBlock"]
        if len(blocks) != shape.layers:
            raise ValueError(f"the MLX model has {len(blocks)} MoE blocks, its config {shape.layers} MoE layers")
        self.shape = shape
        self._ids: list[list[Any]] = [[] for _ in blocks]
        for pos, block in enumerate(blocks):
            block.switch_mlp.__class__ = _recording(type(block.switch_mlp))
            block.switch_mlp.__dict__["_route_sink"] = self._ids[pos]  # not a parameter: outside the module tree

    def clear(self) -> None:
        """Forget what forwards outside a sampler (an evaluation, a test's own forward) recorded."""
        for layer in self._ids:
            layer.clear()

    def take(self) -> np.ndarray:
        """uint8 [rows, tokens, layers, top_k] of every forward since the last take (then forgotten)."""
        import mlx.core as mx

        ids = [list(layer) for layer in self._ids]
        for layer in self._ids:
            layer.clear()
        if not ids[0]:
            raise AssertionError("take() with no forward since the last one")
        per_layer = [mx.concatenate(layer, axis=1) if len(layer) > 1 else layer[0] for layer in ids]
        out = np.stack([np.array(a) for a in per_layer], axis=2)  # [rows, tokens, layers, k]
        return np.sort(out, axis=-1).astype(np.uint8)


_RECORDING: dict[type, type] = {}


def _recording(cls: type) -> type:
    """`cls` (mlx-lm's expert stack) with a __call__ that keeps the expert ids it is handed."""
    if cls in _RECORDING or getattr(cls, "_records_routes", False):
        return _RECORDING.get(cls, cls)

    def __call__(self, x, indices):
        sink = self.__dict__.get("_route_sink")
        if sink is not None:
            sink.append(indices)
        return cls.__call__(self, x, indices)

    _RECORDING[cls] = type(f"Recording{cls.__name__}", (cls,), {"__call__": __call__, "_records_routes": True})
    return _RECORDING[cls]
