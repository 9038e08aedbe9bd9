"""The interface every architecture implements (Architecture) and the HF tensors one conversion takes by
name (HfTensors); qwen2.py, llama.py and lfm2.py implement it, registry.py names them by HF `model_type`.

An architecture says how its HF config becomes a megatron-core model and how its tensors map both ways.
Megatron-side names are the module names of the local layer spec (`model.state_dict()`); the
checkpoint keys are produced from them by megatron's own `sharded_state_dict`, so one mapping serves
the local and the Transformer Engine spec alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .hf_io import ConvertError


class Architecture:
    """Interface every architecture implements (see qwen2.py for the reference implementation)."""

    #: HF `model_type` values this class converts
    model_types: tuple[str, ...] = ()

    def validate(self, cfg: Mapping[str, Any]) -> None:
        """Raise ConvertError for any config feature the mapping does not support."""
        raise NotImplementedError

    def transformer_config(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """megatron TransformerConfig fields that describe the model's shape and maths."""
        raise NotImplementedError

    def gpt_model_kwargs(self, cfg: Mapping[str, Any], padded_vocab_size: int) -> dict[str, Any]:
        """Keyword arguments of GPTModel besides config and layer spec."""
        raise NotImplementedError

    def hf_to_megatron(self, hf: Mapping[str, Any], cfg: Mapping[str, Any], padded_vocab_size: int) -> dict[str, Any]:
        """Full (unsharded) HF tensors -> full megatron tensors under local-spec module names."""
        raise NotImplementedError

    def megatron_to_hf(self, mg: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
        """Full megatron tensors -> HF tensors (the exact inverse of hf_to_megatron)."""
        raise NotImplementedError

    def runtime_layout(self, hf: dict[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
        """`megatron_to_hf`'s tensors (the Hub checkpoints' form) in the layout the installed transformers holds
        the model in memory: what the hf backend publishes and a torch worker loads. The same by default."""
        return hf

    def rotary_inv_freq(self, cfg: Mapping[str, Any], inv_freq: Any) -> Any:
        """The rotary inverse frequencies the model uses, from megatron's plain ones (`inv_freq`, [d/2]
        float32); overridden where the architecture scales them (Llama 3.x)."""
        return inv_freq

    def slime_model_flags(self, cfg: Mapping[str, Any], rotary_base: float) -> list[str]:
        """The Megatron-LM flags that build this model inside slime (infra/slime_launch.py passes them);
        an architecture without them runs on the native engine only."""
        raise ConvertError(f"model_type={cfg.get('model_type')!r} has no Megatron-LM flags for the slime engine "
                           "(trainer/models/registry.py); use the native engine, or pass the model flags in "
                           "launch.extra_args")

    def layer_spec(self, cfg: Mapping[str, Any], attention: str = "auto") -> Any:
        """The transformer layer spec (or per-layer block spec) GPTModel is built with; one spec for every
        layer by default, overridden by hybrid architectures (LFM2)."""
        from .layer_specs import layer_spec

        return layer_spec(attention)


def flag_number(x: float) -> str:
    """A number as a Megatron-LM flag value: 1000000 for 1e6, 1e-06 as Python writes it."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


class HfTensors:
    """An HF checkpoint's tensors handed out by name to one hf_to_megatron: a missing tensor and one no
    mapping took are both a clear ConvertError, and vocab-sized matrices are padded to megatron's size."""

    def __init__(self, src: Mapping[str, Any], cfg: Mapping[str, Any], padded_vocab_size: int):
        self.src, self.cfg, self.padded_vocab_size = src, cfg, padded_vocab_size
        self.vocab = int(cfg["vocab_size"])
        self.used: set[str] = set()

    def take(self, name: str) -> Any:
        if name not in self.src:
            raise ConvertError(f"HF checkpoint lacks tensor {name!r}; the checkpoint is incomplete or not {self.cfg['model_type']}")
        self.used.add(name)
        return self.src[name]

    def pad_rows(self, t: Any) -> Any:
        """`t` (vocab_size rows) with zero rows appended up to the padded vocab size."""
        import torch

        vocab, padded = self.vocab, self.padded_vocab_size
        if t.shape[0] != vocab:
            raise ConvertError(f"embedding has {t.shape[0]} rows but config.json says vocab_size={vocab}")
        return t if padded == vocab else torch.cat([t, t.new_zeros(padded - vocab, *t.shape[1:])])

    def output_layer(self, tied: bool) -> dict[str, Any]:
        """Megatron's output layer: none when tied to the embedding (a stored tied copy of lm_head, which
        some exports keep, must then be the same matrix), else lm_head padded to the vocab size."""
        import torch

        if not tied:
            return {"output_layer.weight": self.pad_rows(self.take("lm_head.weight"))}
        if "lm_head.weight" in self.src and not torch.equal(self.take("lm_head.weight"),
                                                           self.src["model.embed_tokens.weight"]):
            raise ConvertError("config.json says tie_word_embeddings=true but lm_head.weight differs from embed_tokens")
        return {}

    def check_all_used(self) -> None:
        extra = sorted(set(self.src) - self.used)
        if extra:
            raise ConvertError(f"HF checkpoint has {len(extra)} tensor(s) with no Megatron mapping: {', '.join(extra[:8])}")
