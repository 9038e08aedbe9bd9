"""Llama through the architecture registry: forward parity with transformers' LlamaForCausalLM (tiny random
config, fp32, CPU), plain RoPE and Llama 3.x rope scaling, through megatron's rope and our fused-rope
tables; the exact HF <-> Megatron name round trip; rope scaling in the model identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests import megatron_cpu

#: Llama 3.1's scaling, with the original context shrunk so the tiny model's 16 frequencies fall in all
#: three bands (kept, blended, divided)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def make_tiny_llama(out: Path | None = None, *, scaling: dict | None = None, tied: bool = False,
                    vocab: int = 128, dtype=None, seed: int = 0):
    """A random LlamaForCausalLM (norms random too), saved with a tokenizer when `out` is given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_parameters=rope,
                      tie_word_embeddings=tied, max_position_embeddings=256, rms_norm_eps=1e-5)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.5)
    if dtype is not None:
        model = model.to(dtype)
    if out is not None:
        megatron_cpu.save_with_tokenizer(model, out, vocab)
    return model




def _fused_rope_logits(model, ids):
    """Logits through our SDPA attention with the rope tables handed in (the learner's path)."""
    from trainer.backends.megatron_graphs import fused_rope
    from trainer.backends.megatron_rank import MegatronRank

    t = ids.shape[1]
    sites = [m for m in model.modules() if getattr(m, "fuses_rope", False)]
    assert sites
    emb = model.embedding(input_ids=ids, position_ids=torch.arange(t)[None].expand_as(ids))
    with fused_rope(sites, MegatronRank._rope_tables(model, t, torch.float32)):
        hidden = model.decoder(hidden_states=emb, attention_mask=None, rotary_pos_emb=None)
    return model.output_layer(hidden, weight=model.shared_embedding_or_output_weight()
                              if model.share_embeddings_and_output_weights else None)[0].transpose(0, 1)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_forward_parity_with_transformers(dist, tmp_path, scaling, tied):
    torch.set_num_threads(2)
    hf = make_tiny_llama(scaling=scaling, tied=tied)
    state, cfg = megatron_cpu.saved_state(hf, tmp_path)
    assert not any(k.endswith("_proj.bias") for k in state)
    ids = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(40)[None].expand(3, -1)
    with torch.no_grad():
        ref = hf(ids).logits
        mg = megatron_cpu.megatron_from_hf(cfg, state)
        out = mg(ids, pos, attention_mask=None)
        fused = _fused_rope_logits(mg, ids)
    for got in (out, fused):
        assert got.shape == ref.shape
        diff = (got - ref).abs().max().item()
        assert diff < 1e-5, f"max |logit diff| {diff}"
    lp_ref, lp = ref.log_softmax(-1), out.log_softmax(-1)
    tok = ids[:, 1:, None]
    assert (lp[:, :-1].gather(-1, tok) - lp_ref[:, :-1].gather(-1, tok)).abs().max().item() < 1e-5
    # the scaling is seen: the other rope variant's megatron model does not match transformers
    rope = {"rope_theta": 500000.0, **LLAMA3} if scaling is None else {"rope_type": "default", "rope_theta": 500000.0}
    other = {**cfg, "rope_parameters": rope}
    with torch.no_grad():
        assert (megatron_cpu.megatron_from_hf(other, state)(ids, pos, attention_mask=None) - ref).abs().max().item() > 1e-3


def test_inv_freq_is_transformers_bit_for_bit():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from trainer.models.llama import llama3_inv_freq

    for theta, dim, params in ((500000.0, 128, {**LLAMA3, "original_max_position_embeddings": 8192}),
                               (500000.0, 64, {**LLAMA3, "factor": 32.0}), (10000.0, 32, LLAMA3)):
        cfg = LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, head_dim=dim,
                          rope_parameters={**params, "rope_theta": theta})
        ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        plain = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # megatron's
        assert torch.equal(llama3_inv_freq(plain, **params), ref)


def test_name_round_trip_is_exact_and_biases_are_refused(dist, tmp_path):
    from trainer.models.hf_io import ConvertError
    from trainer.models.model import full_state
    from trainer.models.registry import get_architecture

    for tied in (False, True):
        state, cfg = megatron_cpu.saved_state(make_tiny_llama(scaling=LLAMA3, tied=tied), tmp_path / str(tied))
        arch = get_architecture(cfg)
        back = arch.megatron_to_hf(full_state(megatron_cpu.megatron_from_hf(cfg, state)), cfg)
        assert set(back) == set(state)
        assert all(torch.equal(back[k], state[k]) for k in state)
    for bad, why in (({"attention_bias": True}, "attention_bias"), ({"mlp_bias": True}, "mlp_bias"),
                     ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
                     ({"rope_parameters": {**LLAMA3, "rope_theta": 1e4, "low_freq_factor": None}}, "low_freq_factor")):
        with pytest.raises(ConvertError, match=why):
            arch.validate({**cfg, **bad})
    # Qwen2 does not build rope scaling: refused, not silently plain
    qwen = megatron_cpu.make_tiny_qwen2(tmp_path / "qwen")
    qcfg = json.loads((tmp_path / "qwen" / "config.json").read_text())
    with pytest.raises(ConvertError, match="llama3"):
        get_architecture(qcfg).validate({**qcfg, "rope_parameters": {**LLAMA3, "rope_theta": 1e6}})
    del qwen


def test_identity_records_and_compares_rope_scaling(tmp_path):
    from trainer.models import IdentityMismatch, check_model_identity, identity_from_hf

    make_tiny_llama(tmp_path / "a", scaling=LLAMA3)
    make_tiny_llama(tmp_path / "b", scaling={**LLAMA3, "factor": 4.0})
    make_tiny_llama(tmp_path / "c")
    a, b, c = (identity_from_hf(tmp_path / n) for n in "abc")
    assert a.rope_scaling == LLAMA3 and c.rope_scaling is None and a.rope_theta == 500000.0
    assert a.architecture == "LlamaForCausalLM" and a.model_type == "llama"
    for other in (b, c):
        with pytest.raises(IdentityMismatch, match="rope_scaling"):
            check_model_identity(a, checkpoint=other)
        with pytest.raises(IdentityMismatch, match="rope_scaling"):
            check_model_identity(a, manifest=other.manifest_values())
    assert check_model_identity(a, manifest=a.manifest_values()) is a


def _torch_logprobs(model, prompt, response, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()


@pytest.mark.parametrize(("scaling", "plane"), [(None, "bf16"), (LLAMA3, "bf16"), (LLAMA3, "int8g64")],
                         ids=["plain", "llama3", "llama3-int8g64"])
def test_torch_and_mlx_workers_sample_the_same_llama(tmp_path, scaling, plane):
    """Both workers join one run of a tiny Llama; each one's sampled log-probs are the other's (int8g64:
    within test_mlx_worker.py's tolerance for the quantized kernels), and a worker whose config has
    other rope scaling is refused."""
    import threading

    import numpy as np

    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from tests.worker_fixtures import publish_run, save_tiny_llama
    from worker_contract.manifest import ContractMismatch
    from worker_contract.store.file import FileStore
    from worker_contract.tasks import get_task
    from worker_contract.worker.loop import Worker, WorkerSettings
    from worker_contract.worker.mlx_model import rope_types

    model_dir = save_tiny_llama(tmp_path / "llama", rope_scaling=scaling)
    store = FileStore(tmp_path / "bucket")
    _, manifest, _, _ = publish_run(store, model_dir, "llama-run", n_samples=3, plane=plane)
    assert manifest.rope_scaling == scaling and manifest.architecture == "LlamaForCausalLM"

    def worker(backend, d=model_dir):
        s = WorkerSettings(store=store.url, run="llama-run", model_dir=str(d), worker_id=f"{backend}-1", seed=0,
                           threads=1, backend=backend, mlx_dtype="float32")
        return Worker(s, env={"DRL_N_SAMPLES": "3", "DRL_PULSE_PLANE": plane})

    mw, tw = worker("mlx"), worker("torch")
    assert mw.setup(threading.Event()) and tw.setup(threading.Event())
    assert rope_types(mw.policy.model) == {"llama3" if scaling else "default"}
    assert bool(mw.policy._quantized) == (plane == "int8g64")
    problem = get_task("arithmetic").dataset("train")[0]
    import mlx.core as mx

    def mlx_logprobs(prompt, response, temperature):
        logits = mw.policy.model(mx.array([prompt + response]))[0, len(prompt) - 1:-1].astype(mx.float32) / temperature
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return np.array(mx.take_along_axis(logp, mx.array(response)[:, None], axis=-1)[:, 0])

    tol = 5e-3 if plane == "int8g64" else 2e-4  # MLX's quantized matmul against the dequantized weights
    for w, other in ((mw, lambda p, r, t: _torch_logprobs(tw.policy.model, p, r, t)), (tw, mlx_logprobs)):
        rec = w.sample_group(problem)
        assert len(rec.samples) == 3 and sum(len(s.response_ids) for s in rec.samples) > 3
        for s in rec.samples:
            np.testing.assert_allclose(s.behavior_logprobs, other(rec.prompt_ids, s.response_ids,
                                                                  manifest.temperature), atol=tol)
    # a worker whose model has other rope scaling is not the run's model
    wrong = save_tiny_llama(tmp_path / "wrong", rope_scaling=None if scaling else LLAMA3)
    for backend in ("torch", "mlx"):
        with pytest.raises(ContractMismatch, match="rope_scaling"):
            worker(backend, wrong).setup(threading.Event())


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
def test_native_learner_steps_on_both_backends(dist, tmp_path, scaling):
    """The megatron backend is the same learner as the transformers backend on a Llama: log-probs, loss,
    gradient norm and weights after two steps."""
    from tests.test_megatron_backend import VOCAB, assert_same, recipe, run_steps
    from trainer.backends import get_backend
    from trainer.backends.hf import HFBackend

    torch.set_num_threads(2)
    make_tiny_llama(tmp_path, scaling=scaling, vocab=VOCAB)
    mg = get_backend("megatron").load(tmp_path, recipe("megatron"), device="cpu", attention="sdpa")
    hf = HFBackend.load(tmp_path, recipe("hf"), device="cpu")
    a, b = run_steps(mg), run_steps(hf)
    assert_same(a, b)
    assert a["metrics"][1]["loss"] != a["metrics"][0]["loss"] and "lm_head.weight" in a["state"]


@pytest.mark.integration
def test_convert_cli_round_trip(tmp_path):
    """HF -> torch_dist -> HF through `python -m infra.convert` in a real process: the same tensors back,
    and the identity recorded beside the checkpoint carries the rope scaling."""
    from safetensors.torch import load_file

    from trainer.models import read_identity

    hf_dir = tmp_path / "hf"
    make_tiny_llama(hf_dir, scaling=LLAMA3, dtype=torch.bfloat16)
    out = megatron_cpu.convert_round_trip(hf_dir, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert read_identity(tmp_path / "td").rope_scaling == LLAMA3
    a, b = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_slime_flags_give_megatrons_rope_the_same_frequencies(tmp_path):
    """The slime launch's Llama flags: no QKV bias, and llama3 scaling as --use-rope-scaling with its factor;
    megatron-core's rope built from those flags has our frequencies. A scaling the flags cannot express is
    refused."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from infra import slime_launch as sl
    from trainer.config import resolve
    from trainer.models.registry import get_architecture

    megatron_cpu.install()
    cfg = resolve("gsm8k", env={}, overrides={})
    llama31 = {**LLAMA3, "original_max_position_embeddings": 8192}
    for scaling, want in ((None, []), (llama31, ["--use-rope-scaling", "--rope-scaling-factor", "8"])):
        make_tiny_llama(tmp_path / str(bool(scaling)), scaling=scaling)
        c = json.loads((tmp_path / str(bool(scaling)) / "config.json").read_text())
        flags = sl.model_args(cfg, c)
        assert "--add-qkv-bias" not in flags and "--untie-embeddings-and-output-weights" in flags
        assert flags[flags.index("--rotary-base") + 1] == "500000"
        assert [f for f in flags if "rope-scaling" in f or f == "8"] == want
        rope = RotaryEmbedding(32, 1.0, rotary_base=500000, rope_scaling="--use-rope-scaling" in flags,
                               rope_scaling_factor=8.0, use_cpu_initialization=True)
        ours = get_architecture(c).rotary_inv_freq(c, 1.0 / (500000 ** (torch.arange(0, 32, 2).float() / 32)))
        assert torch.allclose(rope.inv_freq, ours, rtol=1e-6, atol=0)
    c = json.loads((tmp_path / "True" / "config.json").read_text())
    c["rope_parameters"]["original_max_position_embeddings"] = 4096
    with pytest.raises(ValueError, match="use the native engine"):
        sl.model_args(cfg, c)


def test_workers_read_rope_scaling_as_the_trainer_does():
    """run.json's rope_scaling comes from the trainer's reading; a worker reads a 4.x Hub config
    (top-level rope_theta, `rope_scaling`) and a transformers 5 one carrying extra keys the same way."""
    from trainer.models.hf_io import rope_scaling_of
    from worker_contract.worker.identity import rope_scaling

    hub = {"rope_theta": 500000.0, "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8192, "factor": 32}}
    new = {"rope_parameters": {**LLAMA3, "rope_theta": 5e5, "low_freq_factor": 1, "partial_rotary_factor": 1.0}}
    for cfg in (hub, new, {"rope_theta": 1e4}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}):
        assert rope_scaling(cfg) == rope_scaling_of(cfg), cfg
