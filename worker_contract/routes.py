"""MoE routes in the rollout record: the experts each token was routed to while the worker sampled.

    shape = route_shape(config)                  # None for a dense model: nothing is recorded
    blob = encode_routes(prompt_routes, [sample_routes, ...])       # uint8 [tokens, layers, top_k] each
    prompt_routes, sample_routes = decode_routes(record, shape)     # RouteError with a drop reason

Routed tokens: the prompt, then each response up to (not including) its last trained token. One byte per
id, each token's ids sorted, the group in one zstd frame; numpy only (the contract's core has no torch).
More in docs/contract.md (module notes).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import zstandard

from .schema import RecordError, RolloutRecord, RouteBlob, _decompress_bounded

#: one byte per expert id
MAX_EXPERTS = 256
#: zstd level of the routes frame (level 3 and 19 measured within 3% of each other on psqa groups)
ROUTES_ZSTD_LEVEL = 3


class RouteError(RecordError):
    """Routes that do not fit the record or the model; `reason` is the learner's drop reason."""


@dataclass(frozen=True)
class RouteShape:
    """Which layers of a model route tokens to experts, and how many."""

    moe_layers: tuple[int, ...]
    """Indices of the decoder layers with a routed MoE block, in order (the record's layer axis)."""
    num_experts: int
    """Routed experts per MoE layer: every id is below this."""
    top_k: int
    """Experts each token is sent to per MoE layer."""

    @property
    def layers(self) -> int:
        return len(self.moe_layers)


def route_shape(config: Mapping) -> RouteShape | None:
    """The route shape of an HF config (config.json as a dict), None for a dense model.

    LFM2-MoE: layers from `num_dense_layers` on route `num_experts_per_tok` of `num_experts`. Another MoE
    architecture is refused (its router is not hooked), so a run never silently records nothing."""
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    if config.get("model_type") != "lfm2_moe":
        if int(experts) > 1:
            raise ValueError(f"model_type {config.get('model_type')!r} has {experts} experts; routes are recorded "
                             "and replayed for lfm2_moe only: use a dense model or LFM2-MoE")
        return None
    shape = RouteShape(tuple(range(int(config.get("num_dense_layers", 0)), int(config["num_hidden_layers"]))),
                       int(config["num_experts"]), int(config["num_experts_per_tok"]))
    if shape.num_experts > MAX_EXPERTS or not 1 <= shape.top_k <= shape.num_experts or not shape.moe_layers:
        raise ValueError(f"num_experts={shape.num_experts}, num_experts_per_tok={shape.top_k}, "
                         f"{shape.layers} MoE layers: routes record 1..{MAX_EXPERTS} experts, top_k at most that")
    return shape


def routed_response_tokens(loss_mask: Sequence[int]) -> int:
    """Response tokens of a sample that carry routes: those before its last trained token."""
    return max((j for j, m in enumerate(loss_mask) if m), default=0)


def encode_routes(prompt: np.ndarray, samples: Sequence[np.ndarray]) -> RouteBlob:
    """A group's routes as the record carries them; arrays [tokens, layers, top_k] of ids below 256."""
    parts = [np.asarray(prompt), *(np.asarray(s) for s in samples)]
    layers, top_k = parts[0].shape[1:]
    for a in parts:
        if a.ndim != 3 or a.shape[1:] != (layers, top_k):
            raise ValueError(f"routes of shape {a.shape}: every part must be [tokens, {layers}, {top_k}]")
        if a.size and (a.min() < 0 or a.max() >= MAX_EXPERTS):
            raise ValueError(f"expert ids must lie in [0, {MAX_EXPERTS}) to fit a byte; got {a.min()}..{a.max()}")
    ids = np.sort(np.concatenate(parts, axis=0), axis=-1).astype(np.uint8)
    frame = zstandard.ZstdCompressor(level=ROUTES_ZSTD_LEVEL).compress(ids.tobytes())
    return RouteBlob(layers=int(layers), top_k=int(top_k), data=base64.b64encode(frame).decode("ascii"))


def decode_routes(record: RolloutRecord, shape: RouteShape) -> tuple[np.ndarray, list[np.ndarray]]:
    """(prompt routes [P, layers, top_k], each sample's [n_i, layers, top_k]) as uint8, checked against the
    model's shape and the record's tokens; `RouteError` (reason routes_shape or routes_range) otherwise."""
    blob = record.routes
    if blob is None:
        raise RouteError("routes_missing", "the record carries no routes")
    if (blob.layers, blob.top_k) != (shape.layers, shape.top_k):
        raise RouteError("routes_shape", f"routes of {blob.layers} layers x top {blob.top_k}; the model routes "
                         f"{shape.layers} MoE layers x top {shape.top_k}")
    counts = [len(record.prompt_ids)] + [routed_response_tokens(s.loss_mask) for s in record.samples]
    per_token = shape.layers * shape.top_k
    want = sum(counts) * per_token
    try:
        frame = base64.b64decode(blob.data, validate=True)
        raw = _decompress_bounded(frame, limit=want)
    except (binascii.Error, ValueError) as e:  # RecordError is a ValueError: oversized or not zstd
        raise RouteError("routes_shape", f"routes data does not decode to {want} bytes ({e})") from None
    if len(raw) != want:
        raise RouteError("routes_shape", f"routes hold {len(raw)} bytes; {sum(counts)} routed tokens x "
                         f"{shape.layers} layers x top {shape.top_k} need {want}")
    ids = np.frombuffer(raw, dtype=np.uint8).reshape(-1, shape.layers, shape.top_k)
    if ids.size and int(ids.max()) >= shape.num_experts:
        raise RouteError("routes_range", f"expert id {int(ids.max())} >= num_experts {shape.num_experts}")
    if shape.top_k > 1 and ids.size and bool((np.diff(ids.astype(np.int16), axis=-1) <= 0).any()):
        raise RouteError("routes_range", "a token's expert ids are repeated or not sorted")
    ends = np.cumsum(counts)
    parts = np.split(ids, ends[:-1])
    return parts[0], parts[1:]
