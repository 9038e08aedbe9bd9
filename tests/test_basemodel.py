"""The embedded base is the same on every machine: built on one thread whatever the caller's thread count,
so the same config gives the same weights (and so the same RL curve) on a 2-core CI box and a 16-core laptop."""

from __future__ import annotations

import hashlib

import torch

from trainer.basemodel import ensure_base
from trainer.config import EmbeddedBaseConfig
from worker_contract.tasks import get_task

#: the recipe's width (a narrower model's products are too small for torch to split across threads)
SHORT = EmbeddedBaseConfig(sft_steps=6, tokenizer_corpus=300, vocab_size=300)


def _weights(path: str) -> str:
    with open(f"{path}/model.safetensors", "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_the_base_does_not_depend_on_the_callers_thread_count(tmp_path):
    task = get_task("arithmetic")
    before = torch.get_num_threads()
    digests = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            report = ensure_base(SHORT, task, tmp_path / f"threads-{threads}", max_new_tokens=8, eval_problems=4,
                                 log=lambda _: None)
            assert torch.get_num_threads() == threads  # the caller's setting is given back
            digests.append(_weights(report.path))
    finally:
        torch.set_num_threads(before)
    assert digests[0] == digests[1]
