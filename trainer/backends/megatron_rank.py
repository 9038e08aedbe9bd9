"""One tensor-parallel rank of the megatron backend: policy and reference shards, fp32 master weights, AdamW.

Precision: the model computes in the recipe's dtype (bf16 on GPU) while the optimizer updates float32
master copies, into which each micro-batch's gradients are accumulated. The linear layers and the output
layer add their weight gradients into the float32 buffers inside the weight-gradient GEMM
(`trainer/models/fused_linear.py`, where torch supports it: `weight.main_grad` points at the master's
gradient); the remaining parameters' bf16 gradients (embedding, norms, biases) are added with one
multi-tensor launch after each micro-batch's backward. An lr-1e-6 Adam update is below half a bf16 ulp for
most weights, so bf16-only weights would not learn; this is megatron's own mixed-precision scheme.
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..step import TrainBatch
from .base import LossFn, gather_logprobs, micro_batches, run_step
from .megatron_graphs import fused_rope
from .vocab_parallel import chunk_tokens_for, vocab_parallel_logprobs

if TYPE_CHECKING:
    from ..config import RecipeConfig

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
#: tokens per forward when no gradient is needed (reference and behaviour log-probs)
_NOGRAD_TOKENS = 32768


class MegatronRank:
    """The model state of one TP rank. Every rank of the group runs every method (they are collective)."""

    def __init__(self, model_dir: str | Path, cfg: RecipeConfig, *, device: str | torch.device,
                 attention: str = "auto", load: str | Path | None = None, compute_dtype: torch.dtype | None = None,
                 compile_layers: bool = False, fused_wgrad: bool | None = None, cuda_graphs: bool | None = None):
        from megatron.core import parallel_state as ps

        from trainer.models import check_model_identity, identity_from_hf, load_hf_config
        from trainer.models.model import build_model
        from trainer.models.registry import get_architecture

        self.cfg = cfg
        self.device = torch.device(device)
        self.hf_cfg = load_hf_config(model_dir)
        self.identity = identity_from_hf(model_dir)
        check_model_identity(self.identity, rotary_base=cfg.model.rotary_base,
                             rotary_base_source="recipe model.rotary_base")
        self.arch = get_architecture(self.hf_cfg)
        self.publish_dtype = _DTYPES[cfg.model.dtype]
        # bf16 compute on CUDA only (CPU serves tests on tiny models, where fp32 is faster and exact)
        self.dtype = compute_dtype or (self.publish_dtype if self.device.type == "cuda" else torch.float32)
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        if attention == "auto":
            from trainer.models.layer_specs import have_te

            attention = "te" if have_te() else "sdpa"
        self.attention = attention

        def build():
            return build_model(self.hf_cfg, padded_vocab_size=self.identity.padded_vocab_size, dtype=self.dtype,
                               attention=attention, device=self.device.type, init=True)  # init sets TP attributes

        self.model, self.reference = build(), build()
        # our SDPA core attention applies rope itself (fused) when we hand it cos/sin; see _hidden
        self._rope_sites = {id(m): [a for a in m.modules() if getattr(a, "fuses_rope", False)]
                            for m in (self.model, self.reference)}
        self._load_weights(model_dir, load)
        if compile_layers and self.device.type == "cuda":  # torch.compile per decoder layer: measured slower
            for m in (self.model, self.reference):          # on the H200 (33.8% vs 44-47% MFU); kept to compare
                for layer in m.decoder.layers:
                    layer.compile()
        self.reference.eval().requires_grad_(False)
        self.recompute = set_recompute(self.model, cfg.compute.gradient_checkpointing)
        self._setup_optimizer()
        self.fused_wgrad = self._use_main_grads(fused_wgrad)
        self.graphs = self._decoder_graphs(cfg.compute.cuda_graphs if cuda_graphs is None else cuda_graphs)
        self.checkpoint_gate: Any = None  # set by MegatronBackend.attach_checkpoint_gate
        self.replayers = self._routing_replay(cfg)

    def _routing_replay(self, cfg: RecipeConfig) -> dict[int, Any]:
        """With algo.routing_replay on an MoE model, a Replayer per model (trainer/models/routing_replay.py)."""
        from worker_contract.routes import route_shape

        from ..models.routing_replay import Replayer

        self.route_shape = route_shape(self.hf_cfg)
        if not cfg.algo.routing_replay or self.route_shape is None:
            return {}
        if self.graphs is not None:
            raise ValueError("algo.routing_replay cannot run under compute.cuda_graphs (a captured graph replays "
                             "fixed routes): set compute.cuda_graphs: false")
        return {id(m): Replayer.megatron(m, self.route_shape) for m in (self.model, self.reference)}

    def _replayed_logp(self, model: Any, mb: TrainBatch) -> torch.Tensor:
        with self.replaying(model, mb):
            return self.response_logp(model, mb)

    def replaying(self, model: Any, mb: TrainBatch):
        """Replay the micro-batch's routes in `model`'s forwards (and the backward's recomputations) inside."""
        import contextlib

        rep = self.replayers.get(id(model))
        return rep.routes(mb.routes) if rep is not None and mb.routes is not None else contextlib.nullcontext()

    def vocab_size(self) -> int:
        return self.identity.vocab_size

    # -- weights -------------------------------------------------------------------------------------
    def _load_weights(self, model_dir: str | Path, load: str | Path | None) -> None:
        from trainer.models import check_model_identity, read_identity, torch_dist
        from trainer.models.hf_io import iter_tensors, safetensors_files
        from trainer.models.model import load_full_state

        if load is not None:  # a converted torch_dist checkpoint: identity recorded beside it must agree
            check_model_identity(self.identity, checkpoint=read_identity(load))
            torch_dist.load(self.model, load)
            torch_dist.load(self.reference, load)
            return
        hf = {k: v.to(self.dtype) for k, v in iter_tensors(safetensors_files(model_dir))}
        full = self.arch.hf_to_megatron(hf, self.hf_cfg, self.identity.padded_vocab_size)
        del hf
        load_full_state(self.model, full)
        load_full_state(self.reference, full)

    def _setup_optimizer(self) -> None:
        """The memory plan's optimizer: torch's fused AdamW on float32 masters on the GPU (the default), or
        MasterAdamW (megatron_optim.py) where optim.moment_dtype or optim.offload ask for
        another layout. `self.grads`: the float32 gradients the step reads (None: the params' own .grad)."""
        from .megatron_optim import MasterAdamW

        o = self.cfg.optim
        offload = o.offload
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.plan_optimizer = o.moment_dtype != "float32" or offload > 0
        if self.plan_optimizer:
            self.optimizer = MasterAdamW(self.params, lr=o.lr, weight_decay=o.weight_decay,
                                         betas=(o.beta1, o.beta2), eps=o.eps, moments=o.moment_dtype, offload=offload)
            self.masters, self.grads = self.optimizer.masters, self.optimizer.grads
        elif self.dtype == torch.float32:
            self.masters, self.grads = self.params, None  # the model's own weights are the master weights
        else:
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
            for m in self.masters:
                m.grad = torch.zeros_like(m)
            self.grads = [m.grad for m in self.masters]
        if not self.plan_optimizer:
            on_cuda = self.device.type == "cuda"
            self.optimizer = torch.optim.AdamW(self.masters, lr=o.lr, weight_decay=o.weight_decay,
                                               betas=(o.beta1, o.beta2), eps=o.eps, fused=on_cuda or None,
                                               foreach=None if on_cuda else True)
        # which grads this rank counts in the global norm: its TP shards, and replicated ones on rank 0
        self._counted = [bool(getattr(p, "tensor_model_parallel", False)) or self.tp_rank == 0 for p in self.params]

    def _use_main_grads(self, fused: bool | None) -> bool:
        """Point the linear and output-layer weights' `main_grad` at their float32 master gradients, so their
        backward accumulates there (`fused`: None = where the GEMM can add in float32, probed once)."""
        from trainer.models.fused_linear import fused_wgrad_available, is_main_grad_linear

        if self.grads is None or not (fused_wgrad_available(self.device) if fused is None else fused):
            return False
        master_grad = {id(p): g for p, g in zip(self.params, self.grads, strict=True)}
        weights = [m.weight for m in self.model.modules() if is_main_grad_linear(m)]
        if not weights:  # a layer spec without our linears (megatron's stock spec, LFM2): unfused throughout
            return False
        for w in [*weights, self._head_weight(self.model)]:
            if id(w) in master_grad:
                w.main_grad = master_grad[id(w)]
        return True

    def _decoder_graphs(self, wanted: bool) -> Any:
        """CUDA graphs of the training decoder (trainer/backends/megatron_graphs.py), when asked for and
        possible: tensor_parallel 1 and our SDPA attention. On the CPU (tests) the same padded calls run
        eagerly."""
        from .megatron_graphs import DecoderGraphs

        sites = self._rope_sites.get(id(self.model), [])
        if not wanted or self.tp_size > 1 or not sites or self.recompute:
            if wanted:
                log.info("compute.cuda_graphs needs tensor_parallel 1, the sdpa attention and no "
                         "gradient_checkpointing; running eagerly")
            return None
        return DecoderGraphs(self.model, sites, lambda t: self._rope_tables(self.model, t, self.dtype),
                             capture=self.device.type == "cuda")

    def _accumulate(self) -> None:
        """Add this micro-batch's bf16 gradients into the float32 master gradients (one multi-tensor
        launch, not one per parameter) and free them."""
        if self.grads is None:
            return  # float32 model: autograd accumulates in place
        pairs = [(g, p.grad) for g, p in zip(self.grads, self.params, strict=True) if p.grad is not None]
        if pairs:
            torch._foreach_add_([m for m, _ in pairs], [g for _, g in pairs])
        for p in self.params:
            p.grad = None

    # -- forward -------------------------------------------------------------------------------------
    @staticmethod
    def _rope_tables(model: Any, t: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = model.rotary_pos_emb(t)  # [t, 1, 1, d] float32
        return freqs.cos().to(dtype), freqs.sin().to(dtype)  # as megatron's unfused rope casts them

    def _hidden(self, model: Any, ids: torch.Tensor, graphs: Any = None) -> torch.Tensor:
        """Decoder output [t, b, h] (after the final norm), as GPTModel.forward computes it before the head;
        through `graphs` (CUDA graphs of the training pass) when one fits this shape."""
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device).unsqueeze(0).expand(b, t)
        emb = model.embedding(input_ids=ids, position_ids=pos)
        if graphs is not None and (out := graphs(emb)) is not None:
            return out
        sites = self._rope_sites.get(id(model), [])
        if sites and self.recompute and model is self.model and torch.is_grad_enabled():
            for site in sites:  # the backward recomputes each layer: its rope tables must still be there
                site.rope = self._rope_tables(model, t, emb.dtype)
            return model.decoder(hidden_states=emb, attention_mask=None, rotary_pos_emb=None)
        if sites:  # our SDPA attention: causal, rope applied inside it
            with fused_rope(sites, self._rope_tables(model, t, emb.dtype)):
                return model.decoder(hidden_states=emb, attention_mask=None, rotary_pos_emb=None)
        mask = None
        if self.attention == "local":  # megatron's unfused attention needs an explicit mask (True = hidden)
            mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu_(1)[None, None]
        return model.decoder(hidden_states=emb, attention_mask=mask, rotary_pos_emb=model.rotary_pos_emb(t))

    def _head_weight(self, model: Any) -> torch.Tensor:
        if model.share_embeddings_and_output_weights:
            return model.shared_embedding_or_output_weight()
        return model.output_layer.weight

    def response_logp(self, model: Any, mb: TrainBatch) -> torch.Tensor:
        """[b, R] float32 log-probs of the response tokens (0 past each response)."""
        from megatron.core import tensor_parallel

        graphs = self.graphs if model is self.model and torch.is_grad_enabled() else None
        hidden = self._hidden(model, mb.input_ids, graphs)
        rows, cols, pos = mb.response_index()
        targets = mb.input_ids[rows, pos + 1]
        h = hidden[pos, rows]
        if self.tp_size > 1:  # identity forward; backward all-reduces this rank's partial d(hidden)
            h = tensor_parallel.copy_to_tensor_model_parallel_region(h)
        w = self._head_weight(model)
        chunk = chunk_tokens_for(w.shape[0])
        lp = vocab_parallel_logprobs(h, w, targets, self.cfg.algo.temperature, vocab_start=self.tp_rank * w.shape[0],
                                     vocab_size=self.identity.vocab_size, group=self.tp_group, chunk_tokens=chunk)
        out = torch.zeros(mb.loss_mask.shape, dtype=torch.float32, device=lp.device)
        return out.index_put((rows, cols), lp)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Without gradients nothing is kept for a backward pass, so the forward takes up to
        `_NOGRAD_TOKENS` tokens at a time (at least the recipe's micro-batch): fewer, larger launches."""
        model = self.reference if reference else self.model
        batch = batch.to(self.device)
        chunks = micro_batches(batch, self.cfg.compute, min_tokens=_NOGRAD_TOKENS)
        return gather_logprobs(batch, chunks, lambda mb: self._replayed_logp(model, mb))

    # -- training ------------------------------------------------------------------------------------
    def _grad_norm(self) -> torch.Tensor:
        import torch.distributed as dist

        grads = self.grads or [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        norms = torch._foreach_norm(grads)
        counted = [n for n, c in zip(norms, self._counted, strict=True) if c]
        sq = torch.stack(counted).pow(2).sum() if counted else torch.zeros((), device=self.device)
        if self.tp_group is not None:
            dist.all_reduce(sq, group=self.tp_group)
        return sq.sqrt()

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        batch = batch.to(self.device)
        chunks = micro_batches(batch, self.cfg.compute)
        if self.graphs is not None and self.graphs.prepare([(mb.rows, int(mb.input_ids.shape[1])) for mb in chunks],
                                                           int(self.hf_cfg["hidden_size"]), self.dtype):
            self._zero_grads()  # the capture's warm-up passes accumulated into the master gradients
        out = run_step(batch, chunks, loss_fn, forward=lambda mb: self.response_logp(self.model, mb),
                       after_backward=self._accumulate, grad_norm=self._grad_norm, update=self._update,
                       lr=float(self.optimizer.param_groups[0]["lr"]), around=lambda mb: self.replaying(self.model, mb))
        self._zero_grads()
        return out

    def _update(self, norm: torch.Tensor) -> None:
        """Clip the float32 gradients to optim.grad_clip, step, and copy the masters into the model."""
        coef = self.cfg.optim.grad_clip / (norm + 1e-6)
        if float(coef) < 1.0:
            torch._foreach_mul_(self.grads or [p.grad for p in self.params if p.grad is not None], coef)
        if self.checkpoint_gate is not None:  # a checkpoint write still reading the state finishes first
            self.checkpoint_gate.wait()
        self.optimizer.step()
        if not self.plan_optimizer and self.masters is not self.params:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)

    def _zero_grads(self) -> None:
        if self.grads is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            torch._foreach_zero_(self.grads)

    # -- publishing and checkpoints ----------------------------------------------------------------------
    def state_dict_hf(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """HF-named full tensors in the run's dtype, sharing no memory with the model: host copies, or with
        `on_device` copies on this rank's device (the publisher's snapshot). An on-device snapshot never
        leaves the device: the gather, the megatron -> HF conversion and the copies run there, queued on
        the current stream with no host copy and no synchronisation (the step must not wait for them)."""
        from trainer.models.model import full_state

        device = self.device if on_device else torch.device("cpu")
        full = full_state(self.model, device=str(device))  # collective over the TP group
        hf = self.arch.runtime_layout(self.arch.megatron_to_hf(full, self.hf_cfg), self.hf_cfg)  # as a worker loads
        live = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        return {k: _owned(v.to(device=device, dtype=self.publish_dtype), live) for k, v in hf.items()}

    def checkpoint_files(self) -> dict[str, Any]:
        """This rank's checkpoint file, holding the live state (trainer/backends/base.py checkpoint_files)."""
        state = self.optimizer.state_dict()  # MasterAdamW's holds the masters
        masters = state["masters"] if self.plan_optimizer else [m.detach() for m in self.masters]
        return {f"megatron_tp{self.tp_rank:02d}.pt": {"tp_size": self.tp_size, "masters": masters, "optimizer": state}}

    def save_checkpoint(self, path: Path) -> None:
        for name, obj in self.checkpoint_files().items():
            torch.save(obj, Path(path) / name)

    def load_checkpoint(self, path: Path) -> None:
        file = Path(path) / f"megatron_tp{self.tp_rank:02d}.pt"
        state = torch.load(file, map_location=self.device, weights_only=True)
        if state["tp_size"] != self.tp_size:
            raise ValueError(f"{file} was written with tensor_parallel={state['tp_size']}; "
                             f"resume with compute.tensor_parallel={state['tp_size']}")
        if self.plan_optimizer != ("exp_avg_sq" in state["optimizer"]):
            raise ValueError(f"{file} was written under another optim.moment_dtype / optim.offload "
                             "plan; resume with the plan it was written with")
        if self.plan_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
            return
        with torch.no_grad():
            torch._foreach_copy_(self.masters, state["masters"])
            if self.masters is not self.params:
                torch._foreach_copy_(self.params, self.masters)
        self.optimizer.load_state_dict(state["optimizer"])


def set_recompute(model: Any, on: bool) -> bool:
    """Recompute each decoder layer's activations in backward from its input (torch's non-reentrant
    checkpoint), or stop doing so; only while gradients are recorded. Returns `on`."""
    from torch.utils.checkpoint import checkpoint

    for layer in model.decoder.layers:
        layer.__dict__.pop("forward", None)  # back to the class's forward
        if on:
            plain = layer.forward

            def forward(*args: Any, _f: Any = plain, **kwargs: Any) -> Any:
                if torch.is_grad_enabled():
                    return checkpoint(_f, *args, use_reentrant=False, **kwargs)
                return _f(*args, **kwargs)

            layer.forward = forward
    return on


def _owned(t: torch.Tensor, live: set[int]) -> torch.Tensor:
    """`t` as a contiguous tensor with storage of its own: copied if it is a view of a model parameter or
    of a larger buffer (a split of a fused tensor); a fresh tensor from the conversion is kept as it is."""
    storage = t.untyped_storage()
    if storage.data_ptr() in live or storage.nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t
