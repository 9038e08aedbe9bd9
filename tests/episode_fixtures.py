"""Tiny search-episode models for the worker tests: a 16-word tokenizer holding the psqa tags as words (so
a random model writes `<search> ... </search>` often), and an LFM2 or LFM2-MoE (the fleet's architecture) of
that vocabulary saved as an HF directory with its config and tokenizer. Seconds to build; nothing downloaded.
(Not Qwen2: transformers loads a Qwen2 directory's tokenizer as its byte-level BPE whatever the files say.)"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

WORDS = ["<eos>", "<unk>", "<search>", "</search>", "dmd", "gene", "protein", "kinase", "cell", "Question:",
         "Doc", "the", "of", "is", "a", "in"]
"""No answer tags: the stops are EOS and `</search>` alone, so about one turn in six is a search
(`WORDS + ["<answer>", "</answer>"]` gives a model that also answers)."""
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def save_tokenizer(out: Path, words: list[str] = WORDS):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"  # not the model type's own tokenizer class (a BPE for Qwen2)
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return fast


def tiny_search_model(arch: str, seed: int = 0, scale: float = 2.0, words: list[str] = WORDS,
                      search_bias: float = 0.0):
    """A random HF causal LM over `words`: 'lfm2' or 'lfm2_moe' (conv, attention, conv; 4 experts).
    `search_bias` > 0 makes `<search>` likelier everywhere (and `</search>` half as much): at 3 and temperature 1, half
    or more of the episodes on psqa prompts search where the plain model's one in four to six do, for a test that
    must see one. Not for lower temperatures: at 0.7 it repeats `<search>` and never closes one."""
    from transformers import Lfm2Config, Lfm2ForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=len(words), hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=512, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    layers = dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], tie_word_embeddings=True)
    if arch == "lfm2":
        model = Lfm2ForCausalLM(Lfm2Config(**common, **layers, intermediate_size=128, block_auto_adjust_ff_dim=False))
    elif arch == "lfm2_moe":
        model = Lfm2MoeForCausalLM(Lfm2MoeConfig(**common, **layers, intermediate_size=128, moe_intermediate_size=64,
                                                 num_experts=4, num_experts_per_tok=2, num_dense_layers=1))
    else:
        raise ValueError(arch)
    with torch.no_grad():  # logits that are not all ~0 (log-probs spread over a few nats, not log 1/16)
        emb = model.get_input_embeddings().weight
        emb.mul_(scale)
        if search_bias:  # every token shares a large first coordinate, so the last hidden state always points
            # along it and the (tied) output row of a token longer along it gains logit in every context
            shared = 8 * emb[:, 1:].std()
            emb[:, 0] = shared
            emb[words.index("<search>"), 0] += search_bias * shared
            emb[words.index("</search>"), 0] += search_bias / 2 * shared  # closes, but rarely before a query
    model.config.architectures = [type(model).__name__]
    return model.eval()


def save_search_model(out: Path, arch: str, seed: int = 0, words: list[str] = WORDS, search_bias: float = 0.0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model = tiny_search_model(arch, seed, words=words, search_bias=search_bias)
    model.save_pretrained(out)
    save_tokenizer(out, words)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("eos_token_id") == 0, cfg.get("eos_token_id")
    return out


def reseed(policy, seed: int) -> None:
    """Restart a worker policy's random stream: the torch worker's generator, or the MLX worker's key."""
    if hasattr(policy, "generator"):
        policy.generator.manual_seed(seed)
    else:
        import mlx.core as mx

        policy.key = mx.random.key(seed)


def varied_search():
    """A search tool whose every answer differs, so no two samples' tool turns hold the same tokens (one
    sample's tool turn cannot pass for another's)."""
    words = itertools.cycle(["dmd gene", "protein kinase", "the cell", "a gene of the cell", "kinase in a cell"])
    return lambda query: f"Doc 1 {next(words)} is {next(words)}"
