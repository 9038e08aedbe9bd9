"""Shared pieces of the learner tests: a tiny Qwen2 built from a config, a recipe, a run manifest, and
a worker stand-in that writes real rollout records (sampled from the published policy's weights) into
the store. Nothing here replaces our own code: records go through the real schema and store.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from trainer.config import (
    AlgoConfig,
    CheckpointConfig,
    ComputeConfig,
    ContractConfig,
    GateConfig,
    ModelConfig,
    OptimConfig,
    RecipeConfig,
    TrainConfig,
)
from worker_contract import layout
from worker_contract.manifest import RunManifest
from worker_contract.schema import RolloutRecord, Sample, SamplingParams, encode_record
from worker_contract.signing import public_key_b64

VOCAB = 64
N_SAMPLES = 4
MAX_NEW = 6


def tiny_model(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg)


def save_tiny_model(path: Path, seed: int = 0) -> Path:
    tiny_model(seed).save_pretrained(str(path))
    return path


def recipe(staleness: int = 3, **train_kw) -> RecipeConfig:
    """A small recipe; `train_kw` are the fields train held before its split (TrainConfig's, ComputeConfig's,
    and `save_interval` / `keep_checkpoints` for the checkpoint section)."""
    train = dict(backend="hf", anchor_interval=3, num_steps=6, seed=7, poll_interval_s=0.05)
    ckpt = {"interval": train_kw.pop("save_interval", 2), "keep": train_kw.pop("keep_checkpoints", 2)}
    compute = {"micro_batch_size": 4, "vocab_chunk": 24}
    compute.update({k: train_kw.pop(k) for k in list(train_kw) if k in ComputeConfig.model_fields})
    if "compute_dtype" in train_kw:
        compute["dtype"] = train_kw.pop("compute_dtype")
    train.update(train_kw)
    return RecipeConfig(
        name="test", task="arithmetic",
        contract=ContractConfig(n_samples=N_SAMPLES, plane="bf16"),
        model=ModelConfig(dtype="float32"),
        algo=AlgoConfig(groups_per_step=2, staleness=staleness, reuse_cap=2, max_new_tokens=MAX_NEW,
                        temperature=1.0, gate=GateConfig(divergence="tv", delta_low=0.2, delta_high=0.2)),
        optim=OptimConfig(lr=1e-3),
        train=TrainConfig(**train),
        compute=ComputeConfig(**compute),
        checkpoint=CheckpointConfig(**ckpt),
    )


def manifest(run: str, key, *, plane: str = "bf16", staleness: int = 3) -> RunManifest:
    return RunManifest(run=run, n_samples=N_SAMPLES, plane=plane, task="arithmetic", model_id="tiny-qwen2",
                       architecture="Qwen2ForCausalLM", rope_theta=10000.0, vocab_size=VOCAB, hidden_size=32,
                       num_layers=2, num_attention_heads=4, num_key_value_heads=2, tokenizer_digest="0" * 64,
                       chat_template_digest="0" * 64, temperature=1.0, max_new_tokens=MAX_NEW, staleness=staleness,
                       anchor_interval=3, trainer_public_key=public_key_b64(key))


def make_record(run: str, version: int, worker: str, group: str, rng: random.Random,
                model=None) -> RolloutRecord:
    """A group of N_SAMPLES random responses; behaviour log-probs from `model` when given (on-policy)."""
    prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 4))]
    samples = []
    for i in range(N_SAMPLES):
        resp = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, MAX_NEW))]
        if model is not None:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + resp])).logits[0].float()
            lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(resp)[:, None])
            blp = [float(x) for x in lp[:, 0]]
        else:
            blp = [-rng.uniform(0.5, 5.0) for _ in resp]
        mask = [1] * len(resp)
        if len(resp) > 2 and i == 1:
            mask[1] = 0  # a tool-output token: not trained on
            blp[1] = 0.0
        samples.append(Sample(response_ids=resp, behavior_logprobs=blp, loss_mask=mask,
                              reward=float((i + sum(resp)) % 2), finish_reason="stop"))
    return RolloutRecord(run=run, worker_id=worker, group_id=group, policy_version=version, plane="bf16",
                         task="arithmetic", prompt_id=f"p{group}", prompt_ids=prompt,
                         sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW),
                         samples=samples, created_at=time.time())


def put_record(store, record: RolloutRecord) -> str:
    key = layout.rollout_key(record.run, record.policy_version, record.worker_id, record.group_id)
    store.put_if_absent(key, encode_record(record))
    return key
