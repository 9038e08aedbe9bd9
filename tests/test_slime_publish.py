"""The slime publish hook's gather (trainer/slime_plugin/publish.hf_state) on a model built from our layer
spec, as slime builds it with `--spec`: every HF tensor back bit for bit at tensor parallel size 1 and 2
(two gloo ranks on loopback, spawned processes, as tests/test_megatron_backend.py does).

LFM2's conv in_proj is column-parallel with partition stride 3 and linear_fc1 with stride 2: a gather that
concatenates the ranks' slices (slime's, without its stride assertion) scrambles them, so this compares
against the HF checkpoint itself. Qwen2 in slime uses slime's own gather (TE spec, stride 1 or 2 on fc1);
here it runs through ours on the local spec, which is what a Qwen2 `--spec` of ours would publish.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import megatron_cpu

pytestmark = pytest.mark.slow


def _hf_dirs(root: Path) -> dict[str, Path]:
    from tests.test_lfm2_megatron import _tiny_hf
    from tests.test_llama import LLAMA3, make_tiny_llama

    dirs = {"lfm2": root / "lfm2", "qwen2": root / "qwen2", "llama": root / "llama"}
    dirs["lfm2"].mkdir()
    _tiny_hf(dirs["lfm2"])
    megatron_cpu.make_tiny_qwen2(dirs["qwen2"], tied=False, vocab=128, hidden=32, ffn=64)
    make_tiny_llama(dirs["llama"], scaling=LLAMA3)
    return dirs


def _rank(rank: int, port: int, world: int, dirs: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    megatron_cpu.init_distributed(rank, world, port, tp=world)
    from safetensors.torch import load_file

    from trainer.models import get_architecture, load_hf_config
    from trainer.models.lfm2_slime import SPEC
    from trainer.models.model import build_model, load_full_state
    from trainer.slime_plugin import publish

    got = {}
    for name, hf_dir in dirs.items():
        cfg = load_hf_config(hf_dir)
        model = build_model(cfg, dtype=torch.float32, attention="sdpa", fused=False, init=True, device="cpu")
        hf = load_file(Path(hf_dir) / "model.safetensors")
        load_full_state(model, get_architecture(cfg).hf_to_megatron(hf, cfg, cfg["vocab_size"]))
        args = SimpleNamespace(hf_checkpoint=hf_dir, spec=SPEC if name == "lfm2" else ["trainer.models.model", "x"])
        got[name] = publish.hf_state(args, [model])
    if rank == 0:
        torch.save(got, out)
    megatron_cpu.shutdown_distributed()


@pytest.mark.parametrize("tp", [1, 2])
def test_publish_gather_gives_back_every_hf_tensor(tmp_path, tp):
    from safetensors.torch import load_file

    dirs = _hf_dirs(tmp_path)
    out = tmp_path / "got.pt"
    megatron_cpu.spawn_on_a_free_port(_rank, (tp, {k: str(v) for k, v in dirs.items()}, str(out)), nprocs=tp)
    got = torch.load(out, weights_only=False)
    for name, hf_dir in dirs.items():
        want = load_file(hf_dir / "model.safetensors")
        assert set(got[name]) == set(want), (name, sorted(set(got[name]) ^ set(want))[:6])
        bad = [k for k in want if not torch.equal(got[name][k], want[k])]
        assert not bad, f"{name} at TP {tp}: {bad[:6]}"
    assert json.loads((dirs["lfm2"] / "config.json").read_text())["model_type"] == "lfm2_moe"


def test_lfm2_launch_at_tp2_builds_without_sequence_parallel():
    """The conv layers refuse a sequence split (trainer/models/lfm2_layers.py), so the slime launch of LFM2
    at TP 2 must leave --sequence-parallel out; Qwen2 at TP 2 keeps it."""
    from infra import slime_launch as sl
    from trainer.config import resolve

    for recipe, hf_id, want in (("psqa", "LiquidAI/LFM2.5-8B-A1B", False),
                                ("gsm8k", "Qwen/Qwen2.5-1.5B-Instruct", True)):
        cfg = resolve(recipe, env={"DRL_RUN": "tp2"}, overrides={"train.tensor_parallel": 2, "train.engine": "slime"})
        paths = sl.BoxPaths(remote_dir="/root/dRL", run="tp2")
        args = sl.slime_args(cfg, paths, sl.KNOWN_HF_CONFIGS[hf_id])
        assert ("--sequence-parallel" in args) is want, recipe
        assert args[args.index("--tensor-model-parallel-size") + 1] == "2"
