"""Creating a run (trainer/run_init.py), the one way every engine starts a run: run.json, the signing key
and the v1 anchor, idempotent, and refused before anything is written when the model is not the recipe's."""

from __future__ import annotations

import stat

import pytest

from tests import megatron_cpu
from trainer.config import resolve
from trainer.models import IdentityMismatch
from trainer.run_init import create_run
from worker_contract import layout
from worker_contract.manifest import ContractMismatch, load_manifest
from worker_contract.store import NotFound, open_store


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    megatron_cpu.make_tiny_qwen2(d, rope_theta=1e6)
    return d


def recipe(run: str, hf_dir, **algo):
    cfg = resolve("gsm8k", env={"DRL_RUN": run}).model_copy(deep=True)
    cfg.task, cfg.model.hf_id, cfg.model.path = "arithmetic", None, str(hf_dir)
    for k, v in algo.items():
        setattr(cfg.algo, k, v)
    return cfg


def test_new_run_gets_run_json_key_and_v1_then_resumes_identically(tmp_path, hf_dir):
    store, key_file = open_store(f"file://{tmp_path / 'bucket'}"), tmp_path / "state" / "trainer.key"
    cfg = recipe("init-1", hf_dir)
    first = create_run(cfg, store, hf_dir, key_file, publish_base=True, progress=False)
    assert first.base_version == 1 and first.pointer is None and first.anchor_bytes > 0
    assert load_manifest(store, "init-1") == first.manifest
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    again = create_run(cfg, store, hf_dir, key_file, publish_base=True, progress=False)
    assert again.base_version is None and again.pointer == 1
    assert again.manifest == first.manifest and again.fingerprint == first.fingerprint
    with pytest.raises(ContractMismatch, match="temperature"):
        create_run(recipe("init-1", hf_dir, temperature=0.5), store, hf_dir, key_file, publish_base=True,
                   progress=False)


def test_without_the_base_only_the_contract_is_written(tmp_path, hf_dir):
    store = open_store(f"file://{tmp_path / 'bucket'}")
    start = create_run(recipe("init-2", hf_dir), store, hf_dir, tmp_path / "k", publish_base=False)
    assert start.base_version is None and load_manifest(store, "init-2") == start.manifest
    with pytest.raises(NotFound):
        store.get(layout.pointer_key("init-2"))


def test_a_different_rotary_base_is_refused_before_anything_is_written(tmp_path, hf_dir):
    store, key_file = open_store(f"file://{tmp_path / 'bucket'}"), tmp_path / "state" / "trainer.key"
    cfg = recipe("init-3", hf_dir)
    cfg.model.rotary_base = 10000.0
    with pytest.raises(IdentityMismatch, match="rotary base 10000"):
        create_run(cfg, store, hf_dir, key_file, publish_base=True, progress=False)
    assert not key_file.exists()
    with pytest.raises(NotFound):
        load_manifest(store, "init-3")


def test_a_lost_key_is_refused_never_replaced(tmp_path, hf_dir):
    """The run exists in the store and its trainer.key is gone: a new key was made silently and the run could
    then never resume ("different contract"), the new file standing where a backup would be restored."""
    from trainer.run_init import KeyLost

    store, key_file = open_store(f"file://{tmp_path / 'bucket'}"), tmp_path / "state" / "trainer.key"
    cfg = recipe("init-4", hf_dir)
    first = create_run(cfg, store, hf_dir, key_file, publish_base=False)
    backup = key_file.read_bytes()
    key_file.unlink()
    with pytest.raises(KeyLost, match=f"trainer key {first.fingerprint}.*restore that file from a backup"):
        create_run(cfg, store, hf_dir, key_file, publish_base=False)
    assert not key_file.exists()
    key_file.write_bytes(backup)
    key_file.chmod(0o600)
    assert create_run(cfg, store, hf_dir, key_file, publish_base=False).fingerprint == first.fingerprint
