"""The psqa trainer setup's shared base: built once (download -> real conversion -> publish to
`bases/lfm25/`), then pulled by the next box with digests checked; a corrupt copy is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infra import psqa_setup
from trainer.config import resolve
from worker_contract import layout
from worker_contract.store import open_store

REPO = Path(__file__).resolve().parent.parent


def _convert_in_process(hf_dir: Path, td_dir: Path) -> None:
    """The real converter CLI in its own process (with megatron's CPU shims, as CI has no GPU)."""
    script = td_dir.parent / "convert.py"
    script.write_text("import sys\nfrom tests import megatron_cpu\nmegatron_cpu.install()\n"
                      "from infra.convert.__main__ import main\nif __name__ == '__main__':\n"
                      f"    sys.exit(main([{str(hf_dir)!r}, '--out', {str(td_dir)!r}, '--quiet', '--dtype', 'bfloat16']))\n")
    out = subprocess.run([sys.executable, str(script)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.integration
def test_base_is_built_once_then_pulled(tmp_path):
    from tests.test_lfm2_megatron import _tiny_hf

    store = open_store(f"file://{tmp_path / 'bucket'}")
    src = tmp_path / "hub"
    _tiny_hf(src, dtype=torch.bfloat16)
    calls = {"fetch": 0, "convert": 0}

    def fetch(hf_dir: Path) -> str:
        calls["fetch"] += 1
        hf_dir.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            (hf_dir / f.name).write_bytes(f.read_bytes())
        return "abc123"

    def convert(hf_dir: Path, td_dir: Path) -> None:
        calls["convert"] += 1
        _convert_in_process(hf_dir, td_dir)

    box1 = tmp_path / "box1"
    msg = psqa_setup.ensure_base(store, box1 / "hf", box1 / "td", hf_id="LiquidAI/LFM2.5-8B-A1B",
                                 fetch=fetch, convert=convert, provenance={"slime": "deadbeef"})
    assert msg.startswith("built and published bases/lfm25/") and calls == {"fetch": 1, "convert": 1}
    manifest = psqa_setup.read_manifest(store)
    assert manifest.hf_revision == "abc123" and manifest.provenance == {"slime": "deadbeef"}
    assert "hf/config.json" in manifest.files and "torch_dist/latest_checkpointed_iteration.txt" in manifest.files
    assert any(k.startswith("torch_dist/release/") for k in manifest.files)

    # a second box pulls the same bytes and never downloads from the Hub or converts
    box2 = tmp_path / "box2"
    msg = psqa_setup.ensure_base(store, box2 / "hf", box2 / "td", hf_id="LiquidAI/LFM2.5-8B-A1B",
                                 fetch=fetch, convert=convert)
    assert msg.startswith("pulled bases/lfm25/") and calls == {"fetch": 1, "convert": 1}
    for rel in manifest.files:
        part, _, sub = rel.partition("/")
        a = (box1 / ("hf" if part == "hf" else "td") / sub).read_bytes()
        assert a == (box2 / ("hf" if part == "hf" else "td") / sub).read_bytes(), rel
    # the native engine reads the HF directory alone: it pulls that part and no torch_dist
    box4 = tmp_path / "box4"
    msg = psqa_setup.ensure_base(store, box4 / "hf", box4 / "td", hf_id="LiquidAI/LFM2.5-8B-A1B",
                                 fetch=fetch, convert=convert, parts=("hf",))
    hf_files = [rel for rel in manifest.files if rel.startswith("hf/")]
    assert msg.startswith(f"pulled bases/lfm25/hf/ ({len(hf_files)} of {len(hf_files)}") and not (box4 / "td").exists()
    assert calls == {"fetch": 1, "convert": 1}
    # running it again fetches nothing (idempotent)
    assert "(0 of" in psqa_setup.ensure_base(store, box2 / "hf", box2 / "td", hf_id="LiquidAI/LFM2.5-8B-A1B",
                                             fetch=fetch, convert=convert)

    # a corrupted object in the bucket is refused by digest, naming the file
    store.put(layout.base_file_key("lfm25", "hf", "config.json"), b"{}")
    with pytest.raises(ValueError, match="hf/config.json: sha256"):
        psqa_setup.ensure_base(store, tmp_path / "box3" / "hf", tmp_path / "box3" / "td",
                               hf_id="LiquidAI/LFM2.5-8B-A1B", fetch=fetch, convert=convert)
    # and a base of another model is not silently used
    with pytest.raises(ValueError, match="holds LiquidAI"):
        psqa_setup.ensure_base(store, box2 / "hf", box2 / "td", hf_id="Other/Model", fetch=fetch, convert=convert)


def test_base_keys_are_checked():
    assert layout.base_manifest_key("lfm25") == "bases/lfm25/manifest.json"
    assert layout.base_file_key("lfm25", "torch_dist", "release/__0_0.distcp") == "bases/lfm25/torch_dist/release/__0_0.distcp"
    for bad in ("../x", "/abs", "a//b", ""):
        with pytest.raises(ValueError, match="relpath"):
            layout.base_file_key("lfm25", "hf", bad)
    with pytest.raises(ValueError, match="part"):
        layout.base_file_key("lfm25", "weights", "x")


def test_fleet_dry_run_plan_passes_the_fleet_profile(tmp_path):
    """The psqa dry run lists the base/plugin steps, and every plan-level fleet check passes (the
    credential and store rows need a real R2 bucket, which a loopback test does not have)."""
    from infra.launch_gpu import build_plan
    from infra.launch_plan import parse_plan, render_plan
    from infra.preflight import build_context, run_checks
    from trainer.config import resolve

    env = {"DRL_RUN": "psqa-dry-1"}
    cfg = resolve("psqa", env=env, overrides={"train.engine": "slime"})  # the slime engine's base steps
    store = f"file://{tmp_path / 'bucket'}"
    plan = parse_plan(render_plan(build_plan(cfg, host="root@gpu-box", remote_dir="/root/dRL", env=env, store=store)))
    names = [s.name for s in plan.steps]
    assert names.index("base_model") < names.index("install_lfm2_plugin") < names.index("publish_anchor")
    assert "download_model" not in names and "convert_model" not in names
    assert "--spec" in plan.slime_args and "--num-experts" in plan.slime_args
    ctx = build_context(plan, profile="fleet", env=env, env_file=str(tmp_path / "none.r2env"), store=store,
                        run_box=None)
    ctx.run_box = None  # no SSH in this test: the box rows are skipped
    rows = {r.check: r for r in run_checks(ctx)}
    plan_checks = [c for c in rows if c.split(".")[0] in ("contract", "recipe", "model")]
    assert len(plan_checks) >= 10
    assert all(rows[c].status == "PASS" for c in plan_checks), {c: rows[c].seen for c in plan_checks if rows[c].status != "PASS"}


def test_a_native_fleet_launch_takes_the_pinned_base_from_the_bucket_too():
    """REPRODUCE.md pins the fleet's model in bases/lfm25/; the native engine (the recipe's default) once
    downloaded the Hub's newest revision instead, and only ENGINE=slime used the pin."""
    from infra.launch_gpu import build_plan

    env = {"DRL_RUN": "psqa-dry-2"}
    cfg = resolve("psqa", env=env)
    assert cfg.train.engine == "native"
    plan = build_plan(cfg, host="root@gpu-box", remote_dir="/root/dRL", env=env, store="file:///tmp/none")
    steps = {s.name: s for s in plan.steps}
    assert "base_model" in steps and "download_model" not in steps and "install_lfm2_plugin" not in steps
    assert "HF dir," in steps["base_model"].summary and "torch_dist" not in steps["base_model"].summary.split(";")[0]
    names = list(steps)
    assert names.index("install_packages") < names.index("base_model") < names.index("launch_learner")
    # MODEL= names the user's own directory: it is used as it is (download_model's check), never pulled into
    own = resolve("psqa", env=env, overrides={"model.path": "/data/my-lfm2"})
    own_steps = [s.name for s in build_plan(own, host="root@gpu-box", remote_dir="/root/dRL", env=env,
                                            store="file:///tmp/none").steps]
    assert "download_model" in own_steps and "base_model" not in own_steps
    # on slime MODEL= keeps the plugin check and converts the user's directory (no base step does it)
    own_slime = resolve("psqa", env=env, overrides={"model.path": "/data/my-lfm2", "train.engine": "slime"})
    names = [s.name for s in build_plan(own_slime, host="root@gpu-box", remote_dir="/root/dRL", env=env,
                                        store="file:///tmp/none").steps]
    assert {"download_model", "convert_model", "install_lfm2_plugin"} <= set(names) and "base_model" not in names
