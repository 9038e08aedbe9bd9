"""run.json: published create-only; a second create is refused; resume only with the identical contract."""

from __future__ import annotations

import pytest

from worker_contract import layout, signing
from worker_contract.manifest import ContractMismatch, RunExists, RunManifest, create_or_resume, load_manifest
from worker_contract.store import NotFound


def make_manifest(run: str = "test-run", **over) -> RunManifest:
    fields = dict(
        run=run, n_samples=8, plane="bf16", kv_mode=None, task="gsm8k", model_id="tiny-qwen2",
        architecture="Qwen2ForCausalLM", rope_theta=1_000_000.0, vocab_size=512, hidden_size=64,
        num_layers=2, num_attention_heads=4, num_key_value_heads=2, tokenizer_digest="a" * 64,
        chat_template_digest="b" * 64, temperature=1.0, max_new_tokens=64, staleness=3, anchor_interval=10,
        trainer_public_key=signing.public_key_b64(signing.generate_private_key()),
    )
    return RunManifest(**{**fields, **over})


def test_create_publishes_run_json(store):
    m = make_manifest()
    assert create_or_resume(store, m, resume=False) == m
    assert store.exists(layout.manifest_key("test-run"))
    assert load_manifest(store, "test-run") == m


def test_second_create_is_refused(store):
    m = make_manifest()
    create_or_resume(store, m, resume=False)
    with pytest.raises(RunExists, match="choose a fresh DRL_RUN"):
        create_or_resume(store, make_manifest(trainer_public_key=m.trainer_public_key), resume=False)
    assert load_manifest(store, "test-run") == m


def test_resume_with_identical_contract(store):
    m = make_manifest()
    create_or_resume(store, m, resume=False)
    again = m.model_copy(update={"created_at": m.created_at + 3600})  # not part of the contract
    assert create_or_resume(store, again, resume=True) == m


def test_resume_with_different_contract_gives_field_diff(store):
    m = make_manifest()
    create_or_resume(store, m, resume=False)
    other = m.model_copy(update={"n_samples": 4, "plane": "int8g64"})
    with pytest.raises(ContractMismatch) as err:
        create_or_resume(store, other, resume=True)
    text = str(err.value)
    assert "n_samples: published=8 requested=4" in text
    assert "plane: published='bf16' requested='int8g64'" in text
    assert "rope_theta" not in text and "created_at" not in text
    assert load_manifest(store, "test-run") == m


def test_missing_run_json_is_not_found(store):
    with pytest.raises(NotFound):
        load_manifest(store, "no-such-run")


def test_manifest_round_trip_and_validation():
    m = make_manifest(kv_mode="paged_prefix", plane="int8g64")
    assert RunManifest.from_bytes(m.to_bytes()) == m
    with pytest.raises(ValueError):
        make_manifest(n_samples=0)
    with pytest.raises(ValueError):
        make_manifest(plane="fp8")
    with pytest.raises(ValueError):
        RunManifest.from_bytes(m.to_bytes().replace(b'"contract_version": 1', b'"contract_version": 2'))


def test_every_schema_takes_its_plane_names_from_the_plane_registry():
    """A new plane is a module and a line in worker_contract/planes: no schema spells the names out again."""
    import re
    import typing
    from pathlib import Path

    from worker_contract.planes import PLANES, PlaneName

    assert typing.get_args(PlaneName)[0] is str and set(PLANES) == {"bf16", "int8g64"}
    with pytest.raises(ValueError, match="known: bf16, int8g64"):
        make_manifest(plane="fp8")
    root = Path(__file__).resolve().parent.parent
    spelled = [str(p.relative_to(root)) for d in ("worker_contract", "trainer", "infra", "entrypoints")
               for p in (root / d).rglob("*.py") if re.search(r'Literal\[[^\]]*"int8g64"', p.read_text())]
    assert spelled == [], f"plane names spelled out as a Literal type in {spelled}; use worker_contract.planes.PlaneName"
