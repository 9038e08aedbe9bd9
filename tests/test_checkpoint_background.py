"""Checkpoints written off the step (trainer/checkpoint.py BackgroundSaver): the optimizer update of both
backends waits while a write still reads the live state, and a checkpoint written while the next step runs
holds exactly the state of the step it was taken at (the same as a synchronous one)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from learner_fixtures import make_record, recipe, save_tiny_model

from tests import megatron_cpu
from trainer import checkpoint
from trainer.backends import get_backend
from trainer.objectives import policy_loss
from trainer.step import collate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def _step(backend, cfg, seed):
    batch = collate([make_record("r", 1, "w", f"g{seed}", random.Random(seed))])
    batch.ref_logp = backend.logprobs(batch, reference=True)
    return backend.train_step(batch, lambda lp, mb: policy_loss(lp, mb.behavior_logp, mb.ref_logp, mb.advantages,
                                                                mb.loss_mask, cfg.algo))


@pytest.mark.parametrize("kind", ["hf", "megatron"])
def test_the_update_waits_while_a_checkpoint_reads_the_state(model_dir, tmp_path, kind):
    cfg = recipe(backend=kind)
    if kind == "hf":
        backend = get_backend("hf").load(model_dir, cfg, device="cpu")
    else:  # the in-process rank (tensor_parallel 1), on the CPU with the tests' shims
        megatron_cpu.init_distributed()
        megatron_cpu.make_tiny_qwen2(tmp_path, vocab=64, hidden=32, ffn=64)
        backend = get_backend("megatron").load(tmp_path, cfg, device="cpu", attention="sdpa")
    gate = checkpoint.ReadGate()
    assert backend.attach_checkpoint_gate(gate)
    before = backend.state_dict_hf()
    gate.close()  # a write is reading the state
    done = threading.Event()
    threading.Thread(target=lambda: (_step(backend, cfg, 0), done.set()), daemon=True).start()
    time.sleep(3.0)  # forward and backward of the tiny model take well under a second
    assert not done.is_set()
    assert all(torch.equal(v, before[k]) for k, v in backend.state_dict_hf().items())  # no update yet
    gate.open()
    assert done.wait(60)
    assert gate.waited_s > 2.0
    assert any(not torch.equal(v, before[k]) for k, v in backend.state_dict_hf().items())


def test_a_background_checkpoint_holds_the_state_it_was_taken_at(model_dir, tmp_path):
    cfg = recipe()
    a = get_backend("hf").load(model_dir, cfg, device="cpu")
    _step(a, cfg, 0)
    state = checkpoint.TrainerState(step=1, ledger={"version": 1, "uses": {}}, last_published_version=2)
    sync = checkpoint.save(tmp_path / "sync", state, a)
    saver = checkpoint.BackgroundSaver(a)
    assert saver.overlaps
    saver.start(tmp_path / "bg", state, keep=2)
    after = _step(a, cfg, 1)  # goes on at once; its update waits for the write's read if it is still reading
    saver.wait()
    assert saver.last["checkpoint/step"] == 1 and saver.last["checkpoint/bytes"] > 0
    assert 0 <= saver.last["checkpoint/read_s"] <= saver.last["checkpoint/write_s"]
    bg = checkpoint.latest(tmp_path / "bg")
    assert bg is not None and bg.name == sync.name and checkpoint.damage(bg) is None
    b, c = (get_backend("hf").load(model_dir, cfg, device="cpu") for _ in range(2))
    checkpoint.load(bg, b)
    checkpoint.load(sync, c)
    for x, y in zip(b.state_dict_hf().values(), c.state_dict_hf().values(), strict=True):
        assert torch.equal(x, y)
    again = _step(b, cfg, 1)  # the same weights and moments repeat the step taken after the checkpoint
    assert again["loss"] == after["loss"] and again["grad_norm"] == after["grad_norm"]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict_hf().values(), b.state_dict_hf().values(), strict=True))
