"""Helpers shared by the weight-sync tests: a run in a store, and a tiny policy that takes Adam-like steps."""

from __future__ import annotations

import numpy as np

from worker_contract import signing
from worker_contract.manifest import RunManifest, create_or_resume


def make_run(store, run: str = "ws-run", plane: str = "bf16", key=None, anchor_interval: int = 3):
    key = key or signing.generate_private_key()
    manifest = RunManifest(
        run=run, n_samples=8, plane=plane, kv_mode=None, task="gsm8k", model_id="tiny-qwen2",
        architecture="Qwen2ForCausalLM", rope_theta=1_000_000.0, vocab_size=256, hidden_size=128,
        num_layers=1, num_attention_heads=4, num_key_value_heads=2, tokenizer_digest="a" * 64,
        chat_template_digest="b" * 64, temperature=1.0, max_new_tokens=64, staleness=3,
        anchor_interval=anchor_interval, trainer_public_key=signing.public_key_b64(key))
    create_or_resume(store, manifest, resume=False)
    return manifest, key


class TinyPolicy:
    """fp32 master weights of a small Qwen-shaped block; `step()` moves them like Adam at lr 1e-6 would
    (about lr per element, sign from a random gradient) and `state()` gives HF-named torch tensors."""

    def __init__(self, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.w = {
            "model.embed_tokens.weight": torch.randn(256, 128, generator=g) * 0.02,
            "model.layers.0.self_attn.q_proj.weight": torch.randn(128, 128, generator=g) * 0.02,
            "model.layers.0.self_attn.q_proj.bias": torch.randn(128, generator=g) * 0.02,
            "model.layers.0.input_layernorm.weight": torch.ones(128),
            "model.norm.weight": torch.ones(128),
        }

    def step(self, lr: float = 1e-6) -> None:
        import torch

        for t in self.w.values():
            t.add_(torch.sign(torch.randn(t.shape, generator=self.g)) * lr * 4)

    def state(self) -> dict:
        return {k: v.clone() for k, v in self.w.items()}


def assert_same_bits(a: dict, b: dict) -> None:
    from worker_contract.tensors import to_numpy, words

    assert set(a) == set(b)
    for k in a:
        x, y = to_numpy(a[k]), to_numpy(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert np.array_equal(words(x), words(y)), k
