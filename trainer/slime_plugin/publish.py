"""`--custom-after-train-hook-path trainer.slime_plugin.publish.after_train`: each new policy -> the bucket.

slime calls `after_train(args, rollout_id, model)` on every train rank right after the actor trained on a
rollout (the hook comes from our patch 0001, infra/patches). Every rank gathers its tensor-parallel
shards; rank 0 hands the host copy to the learner's publish queue (trainer/publish/queue.py), as the
native engine does, while slime trains on.
More in docs/slime.md (module notes).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from . import checkpoints
from .context import PluginContext, context


def _is_rank0() -> bool:
    try:
        import torch.distributed as dist

        return not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0
    except ImportError:
        return True


def _slime_hf_state(args: Any, model: list) -> dict[str, Any]:
    """HF-named full tensors from slime's Megatron model, with slime's own converters."""
    from megatron.core import mpu

    if mpu.get_pipeline_model_parallel_world_size() != 1 or mpu.get_expert_model_parallel_world_size() != 1:
        raise ValueError("publishing supports pipeline- and expert-parallel size 1 (one GPU or tensor "
                         "parallelism); set --pipeline-model-parallel-size 1 --expert-model-parallel-size 1")
    if _our_spec(args):  # a model built from our layer spec (LFM2): our gather, our converter names it back
        return _our_arch_hf_state(args, model)
    # slime's default (Transformer Engine) spec, Qwen2: slime's gather and converter. Every tensor there has
    # partition stride 1 (2 for linear_fc1), which slime's gather supports at every commit we launch on.
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
    from slime.backends.megatron_utils.update_weight.common import all_gather_param, named_params_and_buffers

    model_name = getattr(args, "model_name", None)
    if model_name is None:
        from transformers import AutoConfig

        model_name = type(AutoConfig.from_pretrained(args.hf_checkpoint, trust_remote_code=True)).__name__.lower()
    state: dict[str, Any] = {}
    for name, param in named_params_and_buffers(args, model):
        full = all_gather_param(name, param)
        for hf_name, tensor in convert_to_hf(args, model_name, name, full):
            state[hf_name] = tensor.detach().to("cpu", copy=True)
    return state


def _our_spec(args: Any) -> bool:
    """True when slime built the model from one of our layer specs (`--spec trainer.models...`)."""
    spec = getattr(args, "spec", None) or []
    return bool(spec) and str(spec[0]).startswith("trainer.models.")


def _our_arch_hf_state(args: Any, model: list) -> dict[str, Any]:
    """Full Megatron tensors under our converter's names -> HF names (trainer.models registry), the exact
    inverse of the conversion that built the checkpoint slime loaded.

    The gather is ours (trainer.models.model.full_state, stride-aware), not slime's `all_gather_param`:
    slime's asserts `partition_stride == 1` (2 for linear_fc1), and LFM2's conv in_proj is column-parallel
    with stride 3 (each rank holds its slice of B, C and x). slime 5c530c156 asserts at every TP size;
    from 6d485c423 (PR #2220) it returns early at TP 1 and still asserts at TP > 1."""
    from megatron.core import mpu

    from trainer.models import get_architecture, load_hf_config
    from trainer.models.model import full_state

    if mpu.get_expert_tensor_parallel_world_size() != mpu.get_tensor_model_parallel_world_size():
        raise ValueError("publishing our layer spec needs the experts split like the rest: drop "
                         "--expert-tensor-parallel-size (it then equals --tensor-model-parallel-size)")
    cfg = load_hf_config(args.hf_checkpoint)
    mg: dict[str, Any] = {}
    for chunk in model:
        for name, full in full_state(chunk).items():
            while name.startswith("module."):
                name = name[len("module."):]
            mg[name] = full.detach().to("cpu", copy=True)
    return get_architecture(cfg).megatron_to_hf(mg, cfg)


def _is_megatron(chunk: Any) -> bool:
    module = sys.modules.get("megatron.core.transformer.module")  # never loaded: no Megatron model here
    return module is not None and isinstance(chunk, module.MegatronModule)


def hf_state(args: Any, model: Iterable) -> dict[str, Any]:
    """The policy's weights under HF names, as CPU tensors.

    Inside slime (its Megatron actor): slime's Megatron -> HF conversion. Modules that already carry HF
    names (an HF model, as in our tests and the in-repo learner) give their own state dict.
    """
    chunks = list(model)
    if chunks and _is_megatron(chunks[0]):
        return _slime_hf_state(args, chunks)
    state: dict[str, Any] = {}
    for chunk in chunks:
        state.update({k: v.detach().to("cpu", copy=True) for k, v in chunk.state_dict().items()})
    return state


def publish_policy(ctx: PluginContext, state: dict[str, Any], rollout_id: int, *, wait: bool = True) -> int | None:
    """Hand `state` to the learner session's publish queue as the weights of step rollout_id + 1, with the
    report of the batch the rollout side noted for `rollout_id`; with `wait`, return the version once it is
    visible (None when it failed), else None at once."""
    from trainer.step import step_metrics

    session = ctx.session()
    step = rollout_id + 1
    note = ctx.note_for(rollout_id)
    metrics = step_metrics(note, session.audit) if note is not None else session.audit.metrics()
    session.hand_off(state, session.report(note, metrics, step=step))
    if not wait:
        return None
    session.publishing.flush()
    last = session.publishing.last
    return last.version if last is not None and last.step == step else None


def after_train(args: Any, rollout_id: int, model) -> int | None:
    """slime's after-train hook (patch 0001): gather on every rank, publish on rank 0. Returns the version
    when this call waited for it (the last rollout, or no `--num-rollout` known), else None."""
    state = hf_state(args, model)
    if not _is_rank0():
        return None
    ctx = context()
    checkpoints.prune(getattr(args, "save", None), ctx.cfg.checkpoint.keep)  # before slime's next save
    total = getattr(args, "num_rollout", None)
    wait = total is None or rollout_id + 1 >= int(total)
    return publish_policy(ctx, state, rollout_id, wait=wait)
