"""Shared pieces of the worker tests (the torch worker's and the MLX worker's): a tiny Qwen2 with a tokenizer
trained on generated problems, and a run published in a bucket for a worker to join. Nothing here replaces
our own code: the run goes through the real manifest, publisher and store.
"""

from __future__ import annotations

from pathlib import Path

import torch

from worker_contract import signing
from worker_contract.manifest import create_or_resume
from worker_contract.tasks import get_task


def save_tiny_qwen2(out: Path, *, hidden_size: int, intermediate_size: int) -> Path:
    """A 1-layer Qwen2 (2 heads, 1 KV head) and its 300-token tokenizer saved as an HF directory in `out`
    (seconds to build)."""
    from embedded.basemodel import _render, build_model, build_tokenizer
    from embedded.config import EmbeddedBaseConfig

    torch.set_num_threads(1)
    task = get_task("arithmetic")
    train = task.dataset("train")
    tok = build_tokenizer([_render(task, train[i]) for i in range(300)], 300)
    cfg = EmbeddedBaseConfig(hidden_size=hidden_size, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=intermediate_size)
    build_model(tok, cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def publish_run(store, model_dir, run: str, *, n_samples: int, max_new_tokens: int = 12, plane: str | None = None,
                kv_mode: str | None = None, top_p: float | None = None, task: str = "arithmetic"):
    """run.json of `run` (the gsm8k recipe on `task`, the arithmetic task by default, the model in
    `model_dir`) and its v1 anchor in `store`: (the recipe, the manifest, the publisher, the model it
    published). `top_p` is written into run.json alone, as another trainer would write it (our recipes
    refuse top_p < 1)."""
    from transformers import AutoModelForCausalLM

    from trainer.config import resolve
    from trainer.models.identity import identity_from_hf
    from trainer.publish.publisher import Publisher
    from trainer.run_init import run_manifest

    over = {"run": run, "task": task, "contract.n_samples": n_samples, "algo.max_new_tokens": max_new_tokens,
            "model.path": str(model_dir), "algo.temperature": 0.7}
    if plane:
        over["contract.plane"] = plane
    if kv_mode:
        over["contract.kv_mode"] = kv_mode
    cfg = resolve("gsm8k", env={}, overrides=over)
    key = signing.generate_private_key()
    manifest = run_manifest(cfg, identity_from_hf(model_dir), signing.public_key_b64(key))
    if top_p is not None:
        manifest = manifest.model_copy(update={"top_p": top_p})
    manifest = create_or_resume(store, manifest, resume=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    pub = Publisher(store, manifest, key, anchor_interval=10, progress=False)
    pub.publish_anchor(model.state_dict())
    return cfg, manifest, pub, model


def save_tiny_llama(out: Path, *, rope_scaling: dict | None = None) -> Path:
    """A 1-layer Llama (64 wide, 2 heads of 32, 1 KV head, tied) with save_tiny_qwen2's tokenizer; with
    `rope_scaling` (llama3's four fields) its rotary frequencies are Llama 3.x's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from embedded.basemodel import _render, build_tokenizer

    torch.set_num_threads(1)
    task = get_task("arithmetic")
    train = task.dataset("train")
    tok = build_tokenizer([_render(task, train[i]) for i in range(300)], 300)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0, **(rope_scaling or {})},
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
        architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out
