"""The learner backend interface: what the learner loop needs from a model, whatever runs it.

Two backends implement it and register in `trainer.backends`: `hf` (transformers; CPU
and one GPU) and `megatron` (megatron-core; GPU scale). A backend:
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils.checkpoint import checkpoint

from ..step import LossFn, TrainBatch

if TYPE_CHECKING:
    from worker_contract.routes import RouteShape

    from ..config import ComputeConfig, RecipeConfig

# LossFn (trainer/step.py): loss_fn(logp [b, R] with grad, micro-batch) -> (loss reduced over the
# micro-batch's rows, metrics). The backend weights each micro-batch's loss by its share of the batch's
# rows, so the gradient of a step equals the full batch's whatever the micro-batch size (the Dr.GRPO
# reducer divides by rows).

DEFAULT_VOCAB_CHUNK = 8192

log = logging.getLogger(__name__)


def _chunk_lse_and_target(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    local = targets - start
    inside = (local >= 0) & (local < weight.shape[0])
    picked = logits.gather(1, local.clamp(0, weight.shape[0] - 1).unsqueeze(1)).squeeze(1)
    return torch.logsumexp(logits, dim=1), torch.where(inside, picked, torch.zeros_like(picked))


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_VOCAB_CHUNK,
) -> torch.Tensor:
    """log softmax(hidden @ weight.T / temperature)[target] per row, in float32, vocab chunk by chunk.

    hidden [N, H], weight [V, H] (the output embedding), targets [N]. Only an [N, chunk] slice of logits
    exists at a time; under autograd each chunk is recomputed in backward instead of kept.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive")
    h = hidden.float() / temperature
    w = weight.float()
    b = None if bias is None else bias.float() / temperature
    lses, picked = [], torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
    grad = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    for start in range(0, w.shape[0], chunk_size):
        wc = w[start : start + chunk_size]
        bc = None if b is None else b[start : start + chunk_size]
        if grad:
            lse, tgt = checkpoint(_chunk_lse_and_target, h, wc, bc, targets, start, use_reentrant=False)
        else:
            lse, tgt = _chunk_lse_and_target(h, wc, bc, targets, start)
        lses.append(lse)
        picked = picked + tgt
    return picked - torch.logsumexp(torch.stack(lses, dim=0), dim=0)


def micro_batches(batch: TrainBatch, compute: ComputeConfig, *, min_tokens: int = 0) -> list[TrainBatch]:
    """The recipe's forward/backward chunks: `max_tokens_per_gpu` padded tokens when set (at least
    `min_tokens`: gradient-free passes keep nothing for backward and afford more), else
    `micro_batch_size` rows (or as many as `min_tokens` allows, if more)."""
    if compute.max_tokens_per_gpu is not None:
        return batch.micro_batches(batch.rows, max(compute.max_tokens_per_gpu, min_tokens))
    rows = max(compute.micro_batch_size, min_tokens // max(1, int(batch.input_ids.shape[1])))
    return batch.micro_batches(rows)


def combine_metrics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Merge micro-batch metrics: `*_max` max, `*_min` min, `tokens` summed, the rest row-weighted means."""
    total = sum(rows for rows, _ in parts) or 1
    out: dict[str, float] = {}
    for key in {k for _, m in parts for k in m}:
        vals = [(rows, m[key]) for rows, m in parts if key in m]
        if key.endswith("_max"):
            out[key] = max(v for _, v in vals)
        elif key.endswith("_min"):
            out[key] = min(v for _, v in vals)
        elif key == "tokens":
            out[key] = sum(v for _, v in vals)
        else:
            out[key] = sum(r * v for r, v in vals) / total
    return out


def gather_logprobs(batch: TrainBatch, chunks: list[TrainBatch],
                    forward: Callable[[TrainBatch], torch.Tensor]) -> torch.Tensor:
    """[B, R] float32: `forward`'s [b, r] response log-probs of each consecutive chunk, stacked by rows (no
    gradient is taken here: the caller runs it under torch.no_grad)."""
    out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32, device=batch.loss_mask.device)
    row = 0
    for mb in chunks:
        lp = forward(mb)
        out[row : row + mb.rows, : lp.shape[1]] = lp
        row += mb.rows
    return out


def run_step(batch: TrainBatch, chunks: list[TrainBatch], loss_fn: LossFn, *,
             forward: Callable[[TrainBatch], torch.Tensor], grad_norm: Callable[[], torch.Tensor],
             update: Callable[[torch.Tensor], None], lr: float,
             after_backward: Callable[[], None] | None = None,
             around: Callable[[TrainBatch], Any] | None = None) -> dict[str, float]:
    """One optimizer step over `batch`, the loop every backend runs: for each micro-batch of `chunks`,
    `forward` ([b, R] log-probs with grad), `loss_fn`, and a backward of the loss weighted by the chunk's
    share of the batch's rows (then `after_backward`, e.g. folding bf16 grads into float32 masters); then
    `grad_norm()` over the accumulated gradients and, if it is finite, `update(norm)` (clip and step).
    A non-finite norm skips the update: one bad batch must not poison the weights; it is reported as
    `skipped`. Returns the combined loss metrics plus `grad_norm` and `lr` (the rate this step used).
    The caller zeroes the gradients afterwards. `around(mb)`: a context held over a micro-batch's forward
    and backward (routing replay: the backward's recomputation must see the same routes)."""
    parts = []
    for mb in chunks:
        with around(mb) if around is not None else contextlib.nullcontext():
            loss, metrics = loss_fn(forward(mb), mb)
            (loss * (mb.rows / batch.rows)).backward()
        if after_backward is not None:
            after_backward()
        parts.append((mb.rows, metrics))
    norm = grad_norm()
    out = combine_metrics(parts)
    out["grad_norm"] = float(norm)
    out["lr"] = lr
    if math.isfinite(out["grad_norm"]):
        update(norm)
    else:
        log.warning("non-finite gradient norm; optimizer step skipped")
        out["skipped"] = 1.0
    return out


class Backend(abc.ABC):
    """One policy being trained, its optimizer, and a frozen reference copy."""

    #: registry name ("hf", "megatron")
    name: ClassVar[str]
    #: the model's MoE route shape (worker_contract/routes.py); None for a dense model
    route_shape: RouteShape | None = None

    @classmethod
    @abc.abstractmethod
    def load(cls, model_dir: str | Path, cfg: RecipeConfig, *, device: str | None = None) -> Backend:
        """Build policy, reference and optimizer from an HF model directory and the recipe."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Rows of the output embedding."""

    @abc.abstractmethod
    def logprobs(self, batch: TrainBatch, *, reference: bool = False) -> torch.Tensor:
        """[B, R] float32 log-probs of the response tokens (0 past each response), no gradient.

        `reference=True` uses the frozen reference policy instead of the current one.
        """

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over `batch` in micro-batches; gradient clipping included.

        Returns the combined loss_fn metrics plus `grad_norm` and `lr`.
        """

    @abc.abstractmethod
    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """The current weights under HF names, on CPU, in the run's dtype, one entry per tied tensor."""

    def publish_snapshot(self) -> dict[str, torch.Tensor]:
        """The weights to publish, as `state_dict_hf` names them, copied so training can go on: the
        publisher encodes them in the background (trainer/publish/queue.py). A backend whose weights are on
        a GPU in this process keeps the copy there (a device copy, and the publisher encodes on the device);
        the default is the host copy `state_dict_hf` makes."""
        return self.state_dict_hf()

    #: a checkpoint write in flight reads the live state until this gate opens (trainer/checkpoint.py ReadGate);
    #: the optimizer update that would change that state waits for it (`wait_for_checkpoint_read`)
    checkpoint_gate: Any = None

    def checkpoint_files(self) -> dict[str, Any] | None:
        """The checkpoint's files as {file name: object for torch.save}, holding the live state (no copy), for a
        writer thread while training goes on; None where the state is not in this process (the write is then
        synchronous, through `save_checkpoint`)."""
        return None

    def attach_checkpoint_gate(self, gate: Any) -> bool:
        """Make the optimizer update wait on `gate` (see `checkpoint_gate`); False where `checkpoint_files` is None."""
        if type(self).checkpoint_files is Backend.checkpoint_files:
            return False
        self.checkpoint_gate = gate
        return True

    def wait_for_checkpoint_read(self) -> None:
        """Called right before the optimizer update: a checkpoint write still reading the state finishes first."""
        if self.checkpoint_gate is not None:
            self.checkpoint_gate.wait()

    def save_checkpoint(self, path: Path) -> None:
        """Write model and optimizer state into the (existing, empty) directory `path`."""
        files = self.checkpoint_files()
        assert files is not None, f"{type(self).__name__} implements save_checkpoint or checkpoint_files"
        for name, obj in files.items():
            torch.save(obj, Path(path) / name)

    @abc.abstractmethod
    def load_checkpoint(self, path: Path) -> None:
        """Restore what `save_checkpoint` wrote."""
