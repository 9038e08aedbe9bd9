"""The megatron-core backend: GPU scale, tensor parallelism across the GPUs of one host.

The model is megatron-core's GPTModel built from the HF config (trainer/models/model.py: our local layer
spec with torch SDPA as core attention, or Transformer Engine's spec when it is installed), loaded from
the HF safetensors through the same name mapping the converter uses, or from a converted torch_dist
checkpoint (`load=`). Log-probs are computed vocabulary-parallel (trainer/backends/vocab_parallel.py):
no rank ever holds full-vocabulary logits. The learner loop and objective are the transformers backend's:
the same `Backend` interface, the same micro-batch weighting and the same gradient clipping.
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

import importlib
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..step import TrainBatch
from .base import Backend, LossFn

if TYPE_CHECKING:
    from ..config import RecipeConfig

#: "module:function": on a machine without CUDA, the megatron backend runs on the CPU (gloo), each rank calling
#: this hook before megatron is touched. megatron-core has no CPU path: RotaryEmbedding.get_emb moves its
#: frequencies to torch.cuda.current_device() on every forward, so the hook must answer that call (the tests'
#: tests.megatron_cpu:setup_rank does); unset, a machine without CUDA is refused.
CPU_SETUP_ENV = "DRL_MEGATRON_CPU_SETUP"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_setup(setup: str | None) -> None:
    """Call `module:function` before megatron is touched (a hook for the environment a rank runs in)."""
    if setup:
        module, fn = setup.split(":")
        getattr(importlib.import_module(module), fn)()


def init_parallel(rank: int, world: int, device: torch.device, *, port: int | None = None, seed: int = 1234) -> None:
    """torch.distributed + megatron parallel state for one TP group of `world` ranks on this host."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # a loopback rendezvous of our own (the ranks share one host)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                init_method=f"tcp://127.0.0.1:{port or _free_port()}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


class _RankActor:
    """A Ray actor holding one TP rank (wrapped with ray.remote at launch)."""

    def __init__(self, rank: int, world: int, port: int, model_dir: str, cfg: RecipeConfig, device: str,
                 kwargs: dict[str, Any], setup: str | None):
        _run_setup(setup)
        from .megatron_rank import MegatronRank

        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")  # Ray sets CUDA_VISIBLE_DEVICES
        init_parallel(rank, world, dev, port=port, seed=cfg.train.seed)
        self.rank = MegatronRank(model_dir, cfg, device=dev, **kwargs)

    def call(self, method: str, *args: Any) -> Any:
        out = getattr(self.rank, method)(*args)
        if isinstance(out, torch.Tensor):
            return out.cpu()
        return out


class MegatronBackend(Backend):
    name = "megatron"

    def __init__(self, *, local: Any = None, actors: list[Any] | None = None, vocab_size: int,
                 route_shape: Any = None):
        self._local, self._actors, self._vocab = local, actors or [], vocab_size
        self.route_shape = route_shape

    @classmethod
    def load(cls, model_dir: str | Path, cfg: RecipeConfig, *, device: str | None = None,
             attention: str = "auto", load: str | Path | None = None, setup: str | None = None,
             compute_dtype: torch.dtype | None = None, compile_layers: bool = False,
             fused_wgrad: bool | None = None, cuda_graphs: bool | None = None) -> MegatronBackend:
        """`device`: "cuda" (default when available) or "cpu" (tests); `load`: a converted torch_dist root;
        `setup`: "module:function" each rank calls before megatron is imported; `compute_dtype`: the
        model's dtype (default: compute.dtype; its `auto` is the recipe's model.dtype on CUDA, float32 on
        CPU); `fused_wgrad`: accumulate
        weight gradients into the float32 masters inside the GEMM (default: where torch can, probed);
        `cuda_graphs`: the recipe's compute.cuda_graphs unless given."""
        dev = device or ("cuda" if torch.cuda.is_available() else None)
        if dev is None and os.environ.get(CPU_SETUP_ENV):
            dev, setup = "cpu", setup or os.environ[CPU_SETUP_ENV]
        if dev is None:
            raise ValueError("train.backend=megatron needs CUDA GPUs and none is visible; use train.backend=hf "
                             "on a CPU machine")
        if compute_dtype is None and cfg.compute.dtype != "auto":
            from .megatron_rank import _DTYPES

            compute_dtype = _DTYPES[cfg.compute.dtype]
        tp = cfg.compute.tensor_parallel
        if tp < 1:
            raise ValueError(f"compute.tensor_parallel={tp} must be at least 1")
        kwargs = {"attention": attention, "load": None if load is None else str(load), "compute_dtype": compute_dtype,
                  "compile_layers": compile_layers, "fused_wgrad": fused_wgrad, "cuda_graphs": cuda_graphs}
        if tp == 1:
            _run_setup(setup)
            from .megatron_rank import MegatronRank

            d = torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
            init_parallel(0, 1, d, seed=cfg.train.seed)
            rank = MegatronRank(model_dir, cfg, device=d, **kwargs)
            return cls(local=rank, vocab_size=rank.identity.vocab_size, route_shape=rank.route_shape)
        return cls._launch_actors(str(model_dir), cfg, dev, tp, kwargs, setup)

    @classmethod
    def _launch_actors(cls, model_dir: str, cfg: RecipeConfig, dev: str, tp: int, kwargs: dict[str, Any],
                       setup: str | None) -> MegatronBackend:
        import ray

        if not ray.is_initialized():
            from trainer.ray_runtime import init_standalone

            init_standalone()
        if dev == "cuda":
            have = int(ray.cluster_resources().get("GPU", 0))
            if have < tp:
                raise ValueError(f"compute.tensor_parallel={tp} needs {tp} GPUs on this host; Ray sees {have}")
        actor_cls = ray.remote(num_gpus=1 if dev == "cuda" else 0, num_cpus=1)(_RankActor)
        port = _free_port()
        actors = [actor_cls.remote(r, tp, port, model_dir, cfg, dev, kwargs, setup) for r in range(tp)]
        vocab = ray.get([a.call.remote("vocab_size") for a in actors])[0]
        from trainer.models import load_hf_config
        from worker_contract.routes import route_shape

        return cls(actors=actors, vocab_size=vocab, route_shape=route_shape(load_hf_config(model_dir)))

    def _call(self, method: str, *args: Any) -> Any:
        if self._local is not None:
            return getattr(self._local, method)(*args)
        import ray

        return ray.get([a.call.remote(method, *args) for a in self._actors])[0]

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def logprobs(self, batch: TrainBatch, *, reference: bool = False) -> torch.Tensor:
        return self._call("logprobs", batch, reference)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        return self._call("train_step", batch, loss_fn)

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        return self._call("state_dict_hf")

    def publish_snapshot(self) -> dict[str, torch.Tensor]:
        if self._local is not None:  # one rank in this process: the copy stays on its device
            return self._local.state_dict_hf(on_device=True)
        return self.state_dict_hf()  # rank actors hand host copies back through Ray

    def checkpoint_files(self) -> dict[str, Any] | None:
        """The in-process rank's file; None for rank actors (their state is in their processes)."""
        return self._local.checkpoint_files() if self._local is not None else None

    def attach_checkpoint_gate(self, gate: Any) -> bool:
        if self._local is None:
            return False
        self.checkpoint_gate = self._local.checkpoint_gate = gate
        return True

    def save_checkpoint(self, path: Path) -> None:
        self._call("save_checkpoint", Path(path))

    def load_checkpoint(self, path: Path) -> None:
        self._call("load_checkpoint", Path(path))

    def shutdown(self) -> None:
        """Stop the rank actors (tensor_parallel > 1); the in-process rank needs nothing."""
        if self._actors:
            import ray

            for a in self._actors:
                ray.kill(a)
            self._actors = []
