"""HF <-> Megatron conversion on the CPU: logits parity, bit-exact round trips, the torch_dist checkpoint
written by `python -m infra.convert` in a subprocess (megatron's writer spawns), and the model-identity gate.

megatron-core runs here through the test-only CUDA shims in tests/megatron_cpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infra.convert.convert import plan
from tests import megatron_cpu
from trainer.models import (
    ConvertError,
    IdentityMismatch,
    check_model_identity,
    get_architecture,
    identity_from_hf,
    load_hf_config,
    read_identity,
)
from trainer.models.hf_io import iter_tensors, safetensors_files

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mcore():
    torch.set_num_threads(1)
    megatron_cpu.init_distributed()
    yield


def hf_state(d: Path) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(safetensors_files(d)))


def mg_model(cfg, attention="local", dtype=torch.float32):
    from trainer.models.model import build_model

    return build_model(cfg, dtype=dtype, attention=attention, fused=False, device="cpu").eval()


def mg_logits(model, ids):
    b, t = ids.shape
    pos = torch.arange(t).unsqueeze(0).expand(b, t)
    mask = torch.ones(t, t, dtype=torch.bool).triu_(1)[None, None]
    with torch.no_grad():
        return model(ids, pos, mask)


# -- parity and round trips (in process) -------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_logits_parity_and_round_trip(tmp_path, mcore, tied):
    from trainer.models.model import full_state, load_full_state

    hf_model = megatron_cpu.make_tiny_qwen2(tmp_path, tied=tied)
    cfg = load_hf_config(tmp_path)
    arch = get_architecture(cfg)
    src = hf_state(tmp_path)
    assert ("lm_head.weight" in src) == (not tied)
    mg = arch.hf_to_megatron(src, cfg, int(cfg["vocab_size"]))
    ids = torch.randint(0, cfg["vocab_size"], (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(ids).logits
    for attention in ("local", "sdpa"):
        model = mg_model(cfg, attention)
        load_full_state(model, mg)
        out = mg_logits(model, ids)
        err = (out - ref).abs().max().item()
        assert err < 1e-5 * ref.abs().max().item() + 1e-6, (attention, err)
    back = arch.megatron_to_hf(full_state(model), cfg)
    assert set(back) == set(src)
    for k in src:
        assert back[k].dtype == src[k].dtype and torch.equal(back[k], src[k]), k


def test_round_trip_bf16_and_vocab_padding(tmp_path, mcore):
    from trainer.models.model import full_state, load_full_state

    megatron_cpu.make_tiny_qwen2(tmp_path, tied=False, dtype=torch.bfloat16)
    cfg = load_hf_config(tmp_path)
    arch = get_architecture(cfg)
    src = hf_state(tmp_path)
    mg = arch.hf_to_megatron(src, cfg, 160)  # Megatron-style padded vocabulary
    assert mg["embedding.word_embeddings.weight"].shape[0] == 160
    model = mg_model(cfg, dtype=torch.bfloat16)
    with pytest.raises(ConvertError, match="shape"):
        load_full_state(model, mg)  # a 128-row model cannot take the padded tensors
    from trainer.models.model import build_model

    padded = build_model(cfg, padded_vocab_size=160, dtype=torch.bfloat16, attention="local", fused=False, device="cpu")
    load_full_state(padded, mg)
    back = arch.megatron_to_hf(full_state(padded), cfg)
    assert all(torch.equal(back[k], src[k]) for k in src) and set(back) == set(src)


def test_qkv_interleave_is_per_group():
    from trainer.models.qwen2 import interleave_qkv, split_qkv

    nh, ng, d = 4, 2, 1
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # heads 0,1 -> group 0; 2,3 -> group 1
    k, v = torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    fused = interleave_qkv(q, k, v, nh, ng, d)
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, nh, ng, d), (q, k, v), strict=True))


def test_rotary_mismatch_refused_and_changes_logits(tmp_path, mcore):
    """10000 vs 1000000: refused by the gate, and (shown here) a different model if it were not."""
    from trainer.models.model import load_full_state

    hf_model = megatron_cpu.make_tiny_qwen2(tmp_path, rope_theta=1e6)
    ident = identity_from_hf(tmp_path)
    with pytest.raises(IdentityMismatch) as e:
        check_model_identity(ident, rotary_base=10000)
    assert "10000" in str(e.value) and "1000000" in str(e.value)
    assert check_model_identity(ident, rotary_base=1e6) is ident
    with pytest.raises(IdentityMismatch, match="10000"):
        plan(tmp_path, tmp_path / "out", rotary_base=10000)

    cfg = load_hf_config(tmp_path)
    mg = get_architecture(cfg).hf_to_megatron(hf_state(tmp_path), cfg, int(cfg["vocab_size"]))
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf_model(ids).logits
    diffs = {}
    for theta in (1e6, 1e4):
        model = mg_model({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": theta}})
        load_full_state(model, mg)
        diffs[theta] = (mg_logits(model, ids) - ref).abs().max().item()
    assert diffs[1e6] < 1e-5 and diffs[1e4] > 1e-2, diffs


# -- identity gate and input errors (no megatron) ------------------------------------------------------------
def test_identity_checks_checkpoint_and_manifest(tmp_path):
    megatron_cpu.make_tiny_qwen2(tmp_path)
    ident = identity_from_hf(tmp_path)
    assert ident.rope_theta == 1e6 and ident.vocab_size == 128 and ident.num_key_value_heads == 2
    assert ident.tokenizer_digest.startswith("sha256:") and ident.architecture == "Qwen2ForCausalLM"
    run = dict(ident.manifest_values(), vocab_size=151936, rope_theta=10000.0)
    with pytest.raises(IdentityMismatch) as e:
        check_model_identity(ident, manifest=run)
    msg = str(e.value)
    assert "vocab_size: HF model has 128, run.json has 151936" in msg and "rope_theta" in msg
    other = ident.model_copy(update={"tokenizer_digest": "sha256:00"})
    with pytest.raises(IdentityMismatch, match="tokenizer_digest"):
        check_model_identity(ident, checkpoint=other)
    check_model_identity(ident, checkpoint=ident.model_copy(update={"padded_vocab_size": 256}),
                         manifest=ident.manifest_values())
    # a tokenizer change is an identity change
    tok = json.loads((tmp_path / "tokenizer.json").read_text())
    tok["model"]["vocab"]["t1"], tok["model"]["vocab"]["t2"] = 2, 1
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    assert identity_from_hf(tmp_path).tokenizer_digest != ident.tokenizer_digest


def test_clear_errors_for_missing_files_and_bad_config(tmp_path):
    with pytest.raises(ConvertError, match="does not exist"):
        load_hf_config(tmp_path / "nope")
    with pytest.raises(ConvertError, match="config.json is missing"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConvertError, match="not valid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 8}))
    with pytest.raises(ConvertError, match="lacks required field"):
        load_hf_config(tmp_path)
    good = tmp_path / "good"
    megatron_cpu.make_tiny_qwen2(good)
    cfg = json.loads((good / "config.json").read_text())
    (good / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": "4"}))
    with pytest.raises(ConvertError, match="num_attention_heads='4' must be a positive integer"):
        load_hf_config(good)
    (good / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}))
    with pytest.raises(ConvertError, match="yarn"):
        load_hf_config(good)
    from trainer.models import get_architecture

    odd = {**cfg, "use_sliding_window": True, "num_key_value_heads": 3}
    with pytest.raises(ConvertError, match=r"model_type qwen2\) has unsupported settings: use_sliding_window=true.*; "
                       r"num_attention_heads=4 not a multiple of num_key_value_heads=3"):
        get_architecture(odd).validate(odd)  # every unsupported setting named at once
    src = dict(iter_tensors(safetensors_files(good)))
    src["lm_head.weight"] = src["model.embed_tokens.weight"] + 1  # a stored "tied" copy that is not the same
    with pytest.raises(ConvertError, match="tie_word_embeddings=true but lm_head.weight differs"):
        get_architecture(cfg).hf_to_megatron(src, cfg, cfg["vocab_size"])
    (good / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba9"}))
    with pytest.raises(ConvertError, match="model_type=.mamba9. has no Megatron mapping; known: .*qwen2"):
        plan(good, tmp_path / "o")
    (good / "config.json").write_text(json.dumps(cfg))
    (good / "model.safetensors").rename(good / "elsewhere.safetensors")
    with pytest.raises(ConvertError, match="no weights"):
        plan(good, tmp_path / "o")
    (good / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors"}}))
    with pytest.raises(ConvertError, match="missing: .*model-00001"):
        safetensors_files(good)
    (good / "tokenizer.json").unlink()
    with pytest.raises(ConvertError, match="tokenizer.json is missing"):
        identity_from_hf(good)


# -- the torch_dist checkpoint, written by the entry point in a subprocess ------------------------------------
def _run_convert(args: list[str], *, shims: bool = True) -> subprocess.CompletedProcess:
    code = ("import sys; from tests import megatron_cpu; megatron_cpu.install(); " if shims else "import sys; ") + \
        "from infra.convert.__main__ import main; sys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_convert_to_torch_dist_and_back(tmp_path, mcore):
    from infra.convert.convert import export_hf
    from trainer.models import torch_dist
    from trainer.models.model import build_model, full_state

    hf_dir, out = tmp_path / "hf", tmp_path / "mg"
    megatron_cpu.make_tiny_qwen2(hf_dir, tied=True, dtype=torch.bfloat16)
    refused = _run_convert([str(hf_dir), "--out", str(out), "--rotary-base", "10000", "--quiet"])
    assert refused.returncode == 2 and "10000" in refused.stderr and "1000000" in refused.stderr
    assert not out.exists()  # refused before anything was written
    if not torch.cuda.is_available():  # megatron's writer refuses a CPU torch part-way: nothing is left behind
        no_cuda = _run_convert([str(hf_dir), "--out", str(out), "--quiet"], shims=False)
        assert no_cuda.returncode == 2 and "needs a CUDA build of torch" in no_cuda.stderr, no_cuda.stderr[-2000:]
        assert not out.exists(), sorted(p.name for p in out.rglob("*"))

    done = _run_convert([str(hf_dir), "--out", str(out), "--quiet"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    meta = json.loads((out / "release" / "metadata.json").read_text())
    assert meta["sharded_backend"] == "torch_dist"
    assert read_identity(out) == identity_from_hf(hf_dir)
    common = torch.load(out / "release" / "common.pt", weights_only=False)
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0

    again = _run_convert([str(hf_dir), "--out", str(out), "--quiet"])
    assert again.returncode == 2 and "not empty" in again.stderr

    # load in this process (loading needs no shims beyond the test's), compare with the mapping
    cfg = load_hf_config(hf_dir)
    model = build_model(cfg, dtype=torch.bfloat16, attention="local", fused=False, device="cpu")
    torch_dist.load(model, out)
    expect = get_architecture(cfg).hf_to_megatron(hf_state(hf_dir), cfg, 128)
    got = full_state(model)
    assert all(torch.equal(got[k], expect[k]) for k in expect)

    back = tmp_path / "back"
    export_hf(out, back, hf_source=hf_dir, progress=False)
    a, b = hf_state(hf_dir), hf_state(back)
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert (back / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()


def test_a_wrong_hf_dir_is_told_before_torch_loads(tmp_path):
    """The package imports neither torch nor megatron-core, and a directory that is no HF checkpoint is refused
    before they load (about 3 s of imports on a small machine)."""
    code = ("import sys; import infra.convert; from infra.convert.__main__ import main; "
            f"rc = main(['{tmp_path}/nonexistent', '--out', '{tmp_path}/out']); "
            "print(rc, 'torch' in sys.modules, 'megatron' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2", "False", "False"], out.stdout + out.stderr
    assert "nonexistent does not exist" in out.stderr


def test_invoke_convert_dry_run(tmp_path):
    megatron_cpu.make_tiny_qwen2(tmp_path / "hf")
    invoke = [sys.executable, "-m", "invoke", "convert", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "o")]
    ok = subprocess.run(invoke + ["--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["identity"]["rope_theta"] == 1e6
    bad = subprocess.run(invoke + ["--dry-run", "--rotary-base", "10000"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "rotary base 10000" in bad.stderr
    assert not (tmp_path / "o").exists()


def test_overwrite_takes_what_a_killed_conversion_left_and_nothing_else(tmp_path):
    """A conversion killed part-way (SIGKILL: no clean-up ran) leaves its iteration directory alone; --overwrite
    replaces that, and still refuses a directory holding anything else."""
    from infra.convert.convert import _prepare_out
    from trainer.models import torch_dist

    killed = tmp_path / "killed"
    torch_dist.iteration_dir(killed).mkdir(parents=True)
    (torch_dist.iteration_dir(killed) / "common.pt").write_bytes(b"partial")
    with pytest.raises(ConvertError, match="not empty"):
        _prepare_out(killed, overwrite=False)
    _prepare_out(killed, overwrite=True)
    assert killed.is_dir() and not any(killed.iterdir())
    other = tmp_path / "other"
    torch_dist.iteration_dir(other).mkdir(parents=True)
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConvertError, match="does not look like a converted checkpoint"):
        _prepare_out(other, overwrite=True)
    assert (other / "notes.txt").exists()
