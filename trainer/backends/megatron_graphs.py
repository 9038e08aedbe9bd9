"""CUDA graphs for the megatron backend's training pass: the decoder's forward and backward, per shape.

Why: with small micro-batches the training pass is launch-bound. megatron's Python per layer takes longer
than a layer's GPU work at 8 rows of 512 tokens (docs/performance.md: 45% MFU on an H200 at 8 rows, 59% at
32). A CUDA graph replays the decoder's kernels without running that Python. torch's
`make_graphed_callables` captures the forward and the backward of a module for one input shape; the
sequence length is padded up to a multiple of `length_multiple` so that a run needs few graphs, and all
graphs share one memory pool (they run one after the other, never interleaved).
More in docs/performance.md (module notes).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)


@contextlib.contextmanager
def fused_rope(sites: Sequence[Any], tables: tuple[torch.Tensor, torch.Tensor]) -> Iterator[None]:
    """Hand our SDPA attention modules (`sites`) the (cos, sin) tables to apply themselves, for the
    decoder calls inside; the decoder is then called without `rotary_pos_emb`."""
    for site in sites:
        site.rope = tables
    try:
        yield
    finally:
        for site in sites:
            site.rope = None


class _DecoderCall(torch.nn.Module):
    """decoder(hidden) with our attention's fused rope tables for one sequence length."""

    def __init__(self, decoder: torch.nn.Module, sites: Sequence[Any], rope: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        self.decoder = decoder
        self._sites, self._rope = list(sites), rope

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with fused_rope(self._sites, self._rope):
            return self.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=None)


class DecoderGraphs:
    """The graphed decoder calls of one model, keyed by (rows, padded length).

    `rope(length)` gives the (cos, sin) tables our attention applies; `capture=False` runs the same padded
    calls eagerly (how the padding is checked on machines without CUDA); `max_graphs` bounds the number of
    shapes captured (others run eagerly)."""

    def __init__(self, model: Any, sites: Sequence[Any], rope: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 *, capture: bool = True, length_multiple: int = 128, max_graphs: int = 8):
        self.model, self.sites, self.rope = model, list(sites), rope
        self.capture, self.multiple, self.max_graphs = capture, length_multiple, max_graphs
        self.calls: dict[tuple[int, int], Callable[[torch.Tensor], torch.Tensor]] = {}
        self.pool: Any = None
        self.failed = False

    def key(self, rows: int, length: int) -> tuple[int, int]:
        return rows, -(-length // self.multiple) * self.multiple

    def prepare(self, shapes: Sequence[tuple[int, int]], hidden_size: int, dtype: torch.dtype) -> bool:
        """Capture graphs for these (rows, length) shapes; True when any capture ran. Capturing runs a few
        forward and backward passes (torch's warm-up), whose gradients the caller must then zero."""
        ran = False
        for rows, length in shapes:
            key = self.key(rows, length)
            if key in self.calls or self.failed or len(self.calls) >= self.max_graphs:
                continue
            call = _DecoderCall(self.model.decoder, self.sites, self.rope(key[1]))
            if self.capture:
                ran = True
                call = self._graphed(call, key, hidden_size, dtype)
                if call is None:
                    return ran
            self.calls[key] = call
        return ran

    def _graphed(self, call: _DecoderCall, key: tuple[int, int], hidden_size: int, dtype: torch.dtype):
        rows, length = key
        sample = torch.zeros(length, rows, hidden_size, dtype=dtype, device="cuda", requires_grad=True)
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            out = torch.cuda.make_graphed_callables(call, (sample,), allow_unused_input=True, pool=self.pool)
        except Exception as e:  # the eager path computes the same thing; say why once and keep going
            log.warning("CUDA graph capture of the decoder failed (%s: %s); running it eagerly", type(e).__name__, e)
            self.failed = True
            return None
        log.info("captured the decoder as a CUDA graph for %d rows x %d tokens", rows, length)
        return out

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The decoder's output for `hidden` [t, b, h] through a prepared call; None if none fits."""
        t, b, _ = hidden.shape
        key = self.key(b, t)
        call = self.calls.get(key)
        if call is None:
            return None
        if key[1] != t:
            hidden = torch.nn.functional.pad(hidden, (0, 0, 0, 0, 0, key[1] - t))
        return call(hidden)[:t]
