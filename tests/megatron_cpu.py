"""Test-only shims that let megatron-core run on a CPU-only torch (CI has no GPU).

megatron-core has no CPU path: a few calls assume CUDA (on CUDA streams and devices). These
replacements live here, in tests, and nowhere in the product: the product runs on a CUDA host.
More in docs/map.md (module notes).
"""

from __future__ import annotations

import os
import socket

import torch

_INSTALLED = False


def install() -> None:
    """Patch the CUDA calls megatron-core makes unconditionally (no-op on a CUDA build)."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    _INSTALLED = True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_on_a_free_port(fn, args, nprocs: int, attempts: int = 3) -> None:
    """`torch.multiprocessing.spawn(fn, args=(port, *args))` on a free loopback port, picked again when another
    test's process took it between the pick and rank 0's bind (the pick cannot hold it)."""
    for attempt in range(attempts):
        try:
            torch.multiprocessing.spawn(fn, args=(free_port(), *args), nprocs=nprocs)
            return
        except torch.multiprocessing.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == attempts - 1:
                raise


def init_distributed(rank: int = 0, world_size: int = 1, port: int | None = None, tp: int = 1) -> None:
    """gloo process group on loopback + megatron model-parallel state + the no-op RNG tracker."""
    install()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port or free_port())
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def shutdown_distributed() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def make_tiny_qwen2(out_dir, *, tied: bool = True, rope_theta: float = 1e6, vocab: int = 128, hidden: int = 64,
                    layers: int = 2, heads: int = 4, kv_heads: int = 2, ffn: int = 96, seed: int = 0,
                    dtype=None):
    """A random Qwen2ForCausalLM saved as an HF directory (safetensors, config.json, tokenizer.json,
    tokenizer_config.json with a chat template). Norm weights and biases are randomised too, so a
    mapping that drops or swaps them changes the logits. Returns the model (eager attention, fp32)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, rope_theta=rope_theta,
                      tie_word_embeddings=tied, max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    if dtype is not None:
        model = model.to(dtype)
    save_with_tokenizer(model, out_dir, vocab)
    return model


def save_with_tokenizer(model, out_dir, vocab: int) -> None:
    """`model` saved as an HF directory with a word-level tokenizer of `vocab` tokens and a chat template."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(out_dir)
    model.save_pretrained(out)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"}))


def saved_state(model, out_dir) -> tuple[dict, dict]:
    """`model` saved in `out_dir`: its safetensors as read back, and its config.json."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    model.save_pretrained(out_dir)
    return load_file(Path(out_dir) / "model.safetensors"), json.loads((Path(out_dir) / "config.json").read_text())


def megatron_from_hf(cfg, state, attention: str = "sdpa"):
    """A float32 CPU GPTModel of this HF config holding these HF tensors (through the registry), in eval mode."""
    from trainer.models.model import build_model, load_full_state
    from trainer.models.registry import get_architecture

    model = build_model(cfg, dtype=torch.float32, attention=attention, fused=False, device="cpu")
    load_full_state(model, get_architecture(cfg).hf_to_megatron(state, cfg, cfg["vocab_size"]))
    return model.eval()


def convert_round_trip(hf_dir, tmp_path):
    """HF -> torch_dist (tmp_path/td) -> HF (tmp_path/back) through the converter CLI in a real process."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    code = (
        "import sys\nfrom tests import megatron_cpu\nmegatron_cpu.install()\nfrom infra.convert.__main__ import main\n"
        "if __name__ == '__main__':\n"
        f"    rc = main([{str(hf_dir)!r}, '--out', {str(tmp_path / 'td')!r}, '--quiet', '--dtype', 'bfloat16'])\n"
        f"    sys.exit(rc or main([{str(hf_dir)!r}, '--out', {str(tmp_path / 'back')!r}, '--to-hf', "
        f"{str(tmp_path / 'td')!r}, '--quiet']))\n"
    )
    script = tmp_path / "run_convert.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
                          capture_output=True, text=True, timeout=300)


def setup_rank() -> None:
    """`setup=` hook for MegatronBackend ranks started as separate processes (Ray actors) on CPU."""
    install()
    from megatron.core.tensor_parallel import random as mp_random

    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def random_batch(rows: int, vocab: int, *, seed: int = 0, max_prompt: int = 5, max_response: int = 7):
    """A TrainBatch of random right-padded sequences with varied prompt and response lengths."""
    from trainer.step import TrainBatch

    g = torch.Generator().manual_seed(seed)
    pl = torch.randint(1, max_prompt + 1, (rows,), generator=g)
    rl = torch.randint(1, max_response + 1, (rows,), generator=g)
    t, r = int((pl + rl).max()), int(rl.max())
    ids = torch.zeros(rows, t, dtype=torch.long)
    attn = torch.zeros(rows, t, dtype=torch.long)
    mask = torch.zeros(rows, r)
    for i in range(rows):
        n = int(pl[i] + rl[i])
        ids[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        attn[i, :n] = 1
        mask[i, : int(rl[i])] = 1.0
    blp = -torch.rand(rows, r, generator=g) * 4 * mask
    adv = torch.randn(rows, generator=g)
    return TrainBatch(input_ids=ids, attention_mask=attn, prompt_lens=pl, response_lens=rl, loss_mask=mask,
                      behavior_logp=blp, advantages=adv, rewards=adv.clone())
