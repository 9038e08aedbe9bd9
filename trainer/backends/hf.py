"""The transformers backend: CPU and one GPU, for small models and the embedded default.

The policy keeps float32 master weights (an lr-1e-6 Adam update is below half a bf16 ulp for most
weights, so bf16 master weights would not learn); on CUDA the forward runs under bf16 autocast when the
recipe's dtype is bfloat16, unless `compute.dtype` says float32 (tiny models). Published weights
are cast to the recipe's dtype. The reference policy is a frozen copy of the loaded weights in the compute
dtype. Logits are divided by the sampling temperature
and reduced over the vocabulary in chunks (`token_logprobs`, float32); with a bf16 compute dtype (CUDA)
the output layer takes bf16 operands and gives float32 logits, chunked over tokens (`vocab_parallel`).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..step import TrainBatch
from .base import Backend, LossFn, gather_logprobs, micro_batches, run_step, token_logprobs
from .vocab_parallel import chunk_tokens_for, vocab_parallel_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import RecipeConfig

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _pick_device(device: str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class HFBackend(Backend):
    name = "hf"

    def __init__(self, model: PreTrainedModel, cfg: RecipeConfig, *, device: str | None = None,
                 compute_dtype: torch.dtype | None = None):
        self.cfg = cfg
        self.device = _pick_device(device)
        self.publish_dtype = _DTYPES[cfg.model.dtype]
        on_cuda = self.device.type == "cuda"
        # compute.dtype `auto`: bf16 only on CUDA; CPU autocast to bf16 is slow and the CPU path
        # serves tiny models, which need float32 on a GPU too (the recipe's embedded section says so)
        if compute_dtype is None and cfg.compute.dtype != "auto":
            compute_dtype = _DTYPES[cfg.compute.dtype]
        self.compute_dtype = compute_dtype or (self.publish_dtype if on_cuda else torch.float32)
        self.model = model.to(device=self.device, dtype=torch.float32)
        self.model.eval()  # no dropout: the learner's log-probs must match the sampler's
        if cfg.compute.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.reference = copy.deepcopy(self.model).eval()
        # Cast parameters only: `.to(dtype)` would also round buffers such as rotary `inv_freq` to bf16,
        # a 0.4% frequency error that makes the reference a different model at long positions.
        for p in self.reference.parameters():
            p.data = p.data.to(self.compute_dtype)
        self.reference.requires_grad_(False)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps,
        )
        self._check_head(self.model)
        self._replayers = self._routing_replay(cfg)

    def _routing_replay(self, cfg: RecipeConfig) -> dict[int, Any]:
        """The model's route shape, and with algo.routing_replay a Replayer per model (trainer/models/routing_replay.py),
        installed after the reference copy so each model's hooks are its own."""
        from worker_contract.routes import route_shape

        from ..models.routing_replay import Replayer

        self.route_shape = route_shape(self.model.config.to_dict())
        if not cfg.algo.routing_replay or self.route_shape is None:
            return {}
        return {id(m): Replayer.hf(m, self.route_shape) for m in (self.model, self.reference)}

    def _replayed_logp(self, model: PreTrainedModel, mb: TrainBatch) -> torch.Tensor:
        with self._replaying(model, mb):
            return self._response_logp(model, mb)

    def _replaying(self, model: PreTrainedModel, mb: TrainBatch):
        """Replay the micro-batch's routes in `model`'s forwards (and the backward's recomputations) inside."""
        rep = self._replayers.get(id(model))
        return rep.routes(mb.routes) if rep is not None and mb.routes is not None else contextlib.nullcontext()

    @classmethod
    def load(cls, model_dir: str | Path, cfg: RecipeConfig, *, device: str | None = None,
             compute_dtype: torch.dtype | None = None) -> HFBackend:
        """`compute_dtype`: the forward's dtype (default: the recipe's model.dtype on CUDA, float32 on CPU)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        return cls(model, cfg, device=device, compute_dtype=compute_dtype)

    @staticmethod
    def _check_head(model: PreTrainedModel) -> None:
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(model.config, attr, None) not in (None, 1.0):
                raise ValueError(f"model config {attr}={getattr(model.config, attr)!r}: the hf backend computes "
                                 "log-probs from the plain output embedding and does not apply it")

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    # -- forward -----------------------------------------------------------------------------------
    def _autocast(self):
        if self.device.type == "cuda" and self.compute_dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def _response_logp(self, model: PreTrainedModel, mb: TrainBatch) -> torch.Tensor:
        with self._autocast():
            hidden = model.base_model(
                input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False
            ).last_hidden_state
        rows, cols, pos = mb.response_index()
        targets = mb.input_ids[rows, pos + 1]
        head = model.get_output_embeddings()
        if self.compute_dtype != torch.float32 and head.bias is None:
            # bf16 operands, float32 logits, token-chunked (as the megatron backend): a float32 output
            # layer was most of this backend's step time on a GPU
            w = head.weight.to(self.compute_dtype)
            lp = vocab_parallel_logprobs(hidden[rows, pos].to(self.compute_dtype), w, targets,
                                         self.cfg.algo.temperature, chunk_tokens=chunk_tokens_for(w.shape[0]))
        else:
            lp = token_logprobs(hidden[rows, pos], head.weight, targets, self.cfg.algo.temperature,
                                bias=head.bias, chunk_size=self.cfg.compute.vocab_chunk)
        out = torch.zeros(mb.loss_mask.shape, dtype=torch.float32, device=lp.device)
        return out.index_put((rows, cols), lp)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, *, reference: bool = False) -> torch.Tensor:
        model = self.reference if reference else self.model
        batch = batch.to(self.device)
        return gather_logprobs(batch, micro_batches(batch, self.cfg.compute), lambda mb: self._replayed_logp(model, mb))

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        batch = batch.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        params = [p for p in self.model.parameters() if p.requires_grad]
        out = run_step(batch, micro_batches(batch, self.cfg.compute), loss_fn,
                       forward=lambda mb: self._response_logp(self.model, mb),
                       grad_norm=lambda: torch.nn.utils.clip_grad_norm_(
                           [p for p in params if p.grad is not None], self.cfg.optim.grad_clip),
                       update=self._update, lr=float(self.optimizer.param_groups[0]["lr"]))
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def _update(self, _norm: torch.Tensor) -> None:
        """The optimizer step, once a checkpoint write still reading the state is done with it (gradients are
        clipped in `grad_norm`)."""
        self.wait_for_checkpoint_read()
        self.optimizer.step()

    # -- weights and state -------------------------------------------------------------------------
    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        return self._hf_copy(torch.device("cpu"))

    def publish_snapshot(self) -> dict[str, torch.Tensor]:
        return self._hf_copy(self.device)  # on a GPU a device copy: the publisher encodes it there

    def _hf_copy(self, device: torch.device) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, tensor in self.model.state_dict().items():
            ident = (tensor.data_ptr(), tuple(tensor.shape))
            if ident in seen:  # tied weights (lm_head = embed_tokens) are published once, as HF saves them
                continue
            seen.add(ident)
            copy_ = tensor.detach().to(device=device, dtype=self.publish_dtype)
            if copy_.data_ptr() == tensor.data_ptr():  # same device and dtype: never hand out the live weights
                copy_ = copy_.clone()
            out[name] = copy_.contiguous()
        return out

    def checkpoint_files(self) -> dict[str, Any]:
        return {"model.pt": self.model.state_dict(), "optimizer.pt": self.optimizer.state_dict()}

    def load_checkpoint(self, path: Path) -> None:
        path = Path(path)
        state = torch.load(path / "model.pt", map_location=self.device, weights_only=True)
        self.model.load_state_dict(state)
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.device,
                                                  weights_only=True))
