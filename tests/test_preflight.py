"""Preflight: for each profile a passing launch, and one mutation per check that fails exactly that check
and prints its fix. No secret ever reaches the output."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY
from opsbucket import manifest_for
from sshd import sshd_server  # noqa: F401  (real sshd on 127.0.0.1)

from infra import slime_launch as sl
from infra.launch_gpu import build_plan
from infra.launch_plan import LaunchPlan, parse_plan, render_plan
from infra.preflight import _secrets, build_context, main, render_rows, run_checks
from trainer.config import resolve
from worker_contract import layout

REPO = Path(__file__).resolve().parent.parent
RUN = "pf-run-a"
#: profile -> the recipe it launches
RECIPE = {"quickstart": "gsm8k", "fleet": "psqa"}


def make_plan(profile: str, store_url: str, *, env: dict | None = None, overrides: dict | None = None,
              host: str | None = None, remote_dir: str = "/root/dRL") -> LaunchPlan:
    """The launch plan the dry run prints (infra.launch_gpu.build_plan) for the recipe + environment."""
    contract = {"DRL_RUN": RUN, "DRL_N_SAMPLES": "8", "DRL_STORE": store_url,
                "DRL_PULSE_PLANE": "bf16" if profile == "quickstart" else "int8g64"}
    if profile == "fleet":
        contract["DRL_KV_MODE"] = "paged_prefix"
    contract.update(env or {})
    # the slime engine's plan: most rows check its flags (the native engine's row: tests/test_native_launch.py)
    cfg = resolve(RECIPE[profile], contract, {"train.engine": "slime", **(overrides or {})})
    plan = build_plan(cfg, host=host, remote_dir=remote_dir, env=contract, store=store_url)
    assert plan.command[0] == "ray" or cfg.train.engine == "native", plan.notes  # the model flags resolved
    return plan


def set_flag(plan: LaunchPlan, flag: str, value: str) -> LaunchPlan:
    args = list(plan.slime_args)
    args[args.index(flag) + 1] = value
    cmd = list(plan.command)
    cmd[len(cmd) - len(args):] = args
    return plan.model_copy(update={"slime_args": args, "command": cmd})


def local_box(path_prefix: str | None = None):
    """Run box commands in a real shell on this machine (the box is this machine)."""
    env = dict(os.environ)
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"

    def run(cmd: str) -> tuple[int, str]:
        r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=30)
        return r.returncode, r.stdout

    return run


def make_gpu_shim(tmp_path, gpu: str = "NVIDIA H100 80GB HBM3, 81559 MiB", free_gb: int = 500) -> str:
    """This machine has no GPU and whatever disk its host left free: an nvidia-smi that reports a GPU and a df
    that reports `free_gb` free, both as the real tools print them, so the box rows do not depend on the
    machine the tests run on (tests/test_preflight.py::test_box_checks_over_real_ssh reads the real df)."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    (d / "nvidia-smi").write_text(f"#!/bin/sh\necho '{gpu}'\n")
    kb = free_gb * 10**9 // 1024
    (d / "df").write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                          f"echo '/dev/box {2 * kb} {kb} {kb} 50% /'\n")
    for tool in ("nvidia-smi", "df"):
        (d / tool).chmod(0o755)
    return str(d)


@pytest.fixture
def gpu_shim(tmp_path):
    return make_gpu_shim(tmp_path)


@pytest.fixture
def s3_env(moto_server):
    return moto_server.env()


def report(plan, profile, *, env=None, **kw):
    """(rows, rendered text) of a preflight over `plan`, after the plan's own render/parse round trip."""
    plan = parse_plan(render_plan(plan))
    ctx = build_context(plan, profile=profile, env={"PATH": os.environ["PATH"], **(env or {})}, **kw)
    rows = run_checks(ctx)
    text = render_rows(rows, profile, _secrets(ctx.env))
    assert TEST_SECRET_KEY not in text and TEST_ACCESS_KEY not in text
    return rows, text


def fails(rows):
    return [r.check for r in rows if r.status == "FAIL"]


# -- passing configurations -----------------------------------------------------------------------------
def test_quickstart_passes(file_store):
    rows, text = report(make_plan("quickstart", file_store.url), "quickstart")
    assert fails(rows) == [] and "0 FAIL" in text
    assert {r.check for r in rows} >= {"contract.n_samples", "recipe.algo", "recipe.batch", "bucket", "run_id",
                                       "base_anchor", "model.rotary_base", "credentials"}
    assert not list(file_store.list(layout.run_prefix(RUN)))  # the probe was removed


def test_fleet_passes_on_s3(s3_store, s3_env):
    rows, text = report(make_plan("fleet", s3_store.url), "fleet", env=s3_env)
    assert fails(rows) == [], text
    assert {"contract.kv_mode", "recipe.save_interval", "recipe.dual_clip", "store"} <= {r.check for r in rows}
    assert not list(s3_store.list(layout.run_prefix(RUN)))


def test_quickstart_box_checks_pass(file_store, gpu_shim, tmp_path):
    rows, text = report(make_plan("quickstart", file_store.url, remote_dir=str(tmp_path)), "quickstart",
                        run_box=local_box(gpu_shim))
    assert fails(rows) == [], text
    assert {"box.gpu", "box.disk", "box.ray_dashboard"} <= {r.check for r in rows}


# -- one mutation per check -----------------------------------------------------------------------------
def _publish(store, profile="quickstart", **changes):
    """run.json as the profile's launch would publish it, with `changes`."""
    same = {"quickstart": dict(task="gsm8k", max_new_tokens=1024, vocab_size=151936),
            "fleet": dict(task="psqa", max_new_tokens=4096, vocab_size=65536, plane="int8g64",
                          kv_mode="paged_prefix")}[profile]
    m = manifest_for(RUN).model_copy(update={"anchor_interval": 10, "rope_theta": 1e6, **same, **changes})
    store.put_if_absent(layout.manifest_key(RUN), m.to_bytes())


def _env_update(plan, **env):
    return plan.model_copy(update={"env": {**plan.env, **env}})


def _no_model(plan):
    model = {"hf_id": None, "path": None, "rotary_base": None, "dtype": "bfloat16"}
    return plan.model_copy(update={"recipe": {**plan.recipe, "model": model}})


def _loose_env_file(store, tmp_path):
    f = tmp_path / "r2env"
    f.write_text(f"AWS_SECRET_ACCESS_KEY={TEST_SECRET_KEY}\n")
    f.chmod(0o644)
    return {"env_file": str(f)}


def _block_probes(store, tmp_path):
    if store.url.startswith("file://"):  # the run's probes/ is a file: the create-only probe cannot land
        (store.root / RUN).mkdir(parents=True)
        (store.root / RUN / "probes").write_text("in the way")
        return {}
    return {"store": "s3://no-such-bucket-z"}


def _file_store_for_a_box(profile, tmp_path):
    """A file store: fine for the embedded quickstart, wrong once a GPU box (or a fleet) is involved."""
    if profile == "fleet":
        return make_plan(profile, f"file://{tmp_path}/fs"), {}
    plan = make_plan(profile, f"file://{tmp_path}/fs", host="root@gpu-box", remote_dir=str(tmp_path))
    return plan, {"run_box": local_box(make_gpu_shim(tmp_path))}


def _other_plane(profile):
    return "int8g64" if profile == "quickstart" else "bf16"


#: check -> (profiles it applies to, mutation(profile, plan, store, tmp_path) -> (plan, build_context kwargs))
MUTATIONS = {
    "contract.n_samples": ("both", lambda pr, pl, st, tp: (make_plan(pr, st.url, env={"DRL_N_SAMPLES": "4"}), {})),
    "contract.plane": ("both", lambda pr, pl, st, tp: (
        make_plan(pr, st.url, env={"DRL_PULSE_PLANE": _other_plane(pr)}), {})),
    "contract.kv_mode": ("fleet", lambda pr, pl, st, tp: (make_plan(pr, st.url, env={"DRL_KV_MODE": "dense"}), {})),
    "contract.agree": ("both", lambda pr, pl, st, tp: (_env_update(pl, DRL_PULSE_PLANE=_other_plane(pr)), {})),
    "recipe.save_interval": ("fleet", lambda pr, pl, st, tp: (
        make_plan(pr, st.url, overrides={"train.save_interval": 8}), {})),
    "recipe.dual_clip": ("both", lambda pr, pl, st, tp: (
        make_plan(pr, st.url, overrides={"algo.eps_clip_c": 1.0}), {})),
    "recipe.dppo_gate": ("both", lambda pr, pl, st, tp: (set_flag(
        pl, "--custom-tis-function-path", "slime.backends.megatron_utils.loss.icepop_function"), {})),
    "recipe.drgrpo_reducer": ("both", lambda pr, pl, st, tp: (set_flag(
        pl, "--custom-pg-loss-reducer-function-path", "my.reducer"), {})),
    "recipe.no_save_hf": ("both", lambda pr, pl, st, tp: (make_plan(pr, st.url, overrides={
        "launch.extra_args": ["--save-hf", "/root/hf/{rollout_id}"]}), {})),
    "recipe.algo": ("quickstart", lambda pr, pl, st, tp: (make_plan(pr, st.url, overrides={"algo.reuse_cap": 4}), {})),
    "recipe.batch": ("quickstart", lambda pr, pl, st, tp: (
        make_plan(pr, st.url, overrides={"algo.groups_per_step": 4}), {})),
    "model.rotary_base": ("both", lambda pr, pl, st, tp: (set_flag(pl, "--rotary-base", "10000"), {})),
    "model.vocab_tokenizer": ("both", lambda pr, pl, st, tp: (set_flag(pl, "--vocab-size", "151643"), {})),
    "credentials": ("both", lambda pr, pl, st, tp: (pl, _loose_env_file(st, tp))),
    "store": ("both", lambda pr, pl, st, tp: _file_store_for_a_box(pr, tp)),
    "bucket": ("both", lambda pr, pl, st, tp: (pl, _block_probes(st, tp))),
    "run_id": ("both", lambda pr, pl, st, tp: (_publish(st, pr, staleness=5) or pl, {})),
    "base_anchor": ("both", lambda pr, pl, st, tp: (_no_model(pl), {})),
}
CASES = [(pr, check) for check, (where, _) in sorted(MUTATIONS.items())
         for pr in ("quickstart", "fleet") if where in ("both", pr)]


@pytest.mark.parametrize(("profile", "check"), CASES)
def test_mutation_fails_exactly_its_check(request, tmp_path, profile, check):
    store = request.getfixturevalue("file_store" if profile == "quickstart" else "s3_store")
    env = request.getfixturevalue("s3_env") if profile == "fleet" else {}
    plan, kw = MUTATIONS[check][1](profile, make_plan(profile, store.url), store, tmp_path)
    rows, text = report(plan, profile, env=env, **kw)
    assert fails(rows) == [check], text
    row = next(r for r in rows if r.check == check)
    assert row.fix and f"fix: {row.fix}" in text


@pytest.mark.parametrize("profile", ["quickstart", "fleet"])
def test_every_check_of_each_profile_has_a_mutation(request, profile):
    store = request.getfixturevalue("file_store" if profile == "quickstart" else "s3_store")
    env = request.getfixturevalue("s3_env") if profile == "fleet" else {}
    rows, _ = report(make_plan(profile, store.url), profile, env=env)
    assert {r.check for r in rows} == {c for p, c in CASES if p == profile}


def test_contract_agree_fails_when_run_json_differs(file_store):
    _publish(file_store, n_samples=4)
    rows, text = report(make_plan("quickstart", file_store.url), "quickstart")
    assert fails(rows) == ["contract.agree"], text
    assert "run.json=4" in text


def test_run_id_fails_on_a_different_published_contract_and_passes_an_identical_one(file_store):
    _publish(file_store, staleness=5)
    rows, text = report(make_plan("quickstart", file_store.url), "quickstart")
    assert fails(rows) == ["run_id"], text
    assert "staleness published 5, launch 3" in text and "fix: choose a fresh run id" in text


def test_run_id_resumable_with_identical_contract(file_store):
    rows, text = report(make_plan("quickstart", file_store.url), "quickstart")
    assert fails(rows) == [] and "probe written, read back, removed" in text, text
    assert list(file_store.root.iterdir()) == []  # a fresh run's probe leaves no folder behind in a file store
    _publish(file_store)
    rows, text = report(make_plan("quickstart", file_store.url), "quickstart")
    assert fails(rows) == [], text
    assert "contract identical (resume)" in text
    assert [p.name for p in (file_store.root / RUN).iterdir()] == ["run.json"]


def test_credentials_file_not_private(file_store, tmp_path):
    env_file = tmp_path / "r2env"
    env_file.write_text(f"R2_SECRET_ACCESS_KEY={TEST_SECRET_KEY}\n")
    env_file.chmod(0o644)
    rows, text = report(make_plan("quickstart", file_store.url), "quickstart", env_file=str(env_file))
    assert fails(rows) == ["credentials"], text
    assert f"chmod 600 {env_file}" in text
    env_file.chmod(0o600)
    rows, text = report(make_plan("quickstart", file_store.url), "quickstart", env_file=str(env_file))
    assert fails(rows) == [] and "mode 0600" in text


def test_bucket_unwritable(file_store):
    # The run's probes/ path is a file, so the create-only probe cannot be written; reading still works.
    (file_store.root / RUN).mkdir(parents=True)
    (file_store.root / RUN / "probes").write_text("in the way")
    rows, text = report(make_plan("quickstart", file_store.url), "quickstart")
    assert fails(rows) == ["bucket"], text
    assert {r.check: r.status for r in rows}["run_id"] == "WARN"
    assert "did not answer" not in text  # a folder's failure, which the message names: no network advice


def test_bucket_unreachable_on_s3(moto_server, s3_env):
    rows, text = report(make_plan("fleet", "s3://no-such-bucket-x"), "fleet", env=s3_env)
    assert fails(rows) == ["bucket"], text
    assert "Object Read & Write" in text
    # no server answers at all: the fix is the network or the endpoint, not the token's permissions
    from conftest import free_port

    dead = {**s3_env, "DRL_S3_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    rows, text = report(make_plan("fleet", f"s3://{moto_server.new_bucket()}"), "fleet", env=dead)
    assert fails(rows) == ["bucket"], text
    assert "the store did not answer" in text and "Object Read & Write" not in text, text


def test_fleet_refuses_a_file_store(file_store):
    rows, text = report(make_plan("fleet", file_store.url), "fleet")
    assert fails(rows) == ["store"], text
    assert "workers on other machines cannot reach a file store" in text


def test_box_gpu_missing(file_store, tmp_path):
    shim = make_gpu_shim(tmp_path)
    os.remove(f"{shim}/nvidia-smi")  # the box's df, and no GPU tool
    rows, text = report(make_plan("quickstart", file_store.url, remote_dir=str(tmp_path)), "quickstart",
                        run_box=local_box(shim))
    if any(r.check == "box.gpu" and r.status == "PASS" for r in rows):
        pytest.skip("this machine has a GPU")
    assert fails(rows) == ["box.gpu"], text


def test_box_disk_too_small(file_store, tmp_path):
    rows, text = report(make_plan("quickstart", file_store.url, remote_dir=str(tmp_path)), "quickstart",
                        run_box=local_box(make_gpu_shim(tmp_path, free_gb=75)))
    assert fails(rows) == ["box.disk"], text
    assert "75 GB free" in text and ">= 76 GB" in text
    # another run's files and another model are not this launch's room; this run's own (a resume's checkpoint)
    # and the recipe's model are, as the launch's box check counts them (sparse files: their size, no disk)
    from infra import box_check, slime_launch

    plan = make_plan("quickstart", file_store.url, remote_dir=str(tmp_path))
    cfg = resolve(RECIPE["quickstart"], {"DRL_RUN": RUN}, {"train.engine": "slime"})
    paths = slime_launch.BoxPaths(remote_dir=str(tmp_path), run=RUN)
    mine = slime_launch.reused_model_dirs(cfg, paths)
    assert mine == [paths.hf_dir(cfg.model.hf_id), paths.torch_dist_dir(cfg.model.hf_id)]
    for folder, gb in ((tmp_path / ".stoa" / "runs" / "some-other-run", 40), (tmp_path / ".stoa" / "runs" / RUN, 1),
                       (tmp_path / ".stoa" / "models" / "Some--Other-Model", 40), (Path(mine[0]), 1)):
        folder.mkdir(parents=True)
        with open(folder / "state.pt", "wb") as f:
            f.truncate(gb * 10**9)
    rows, text = report(plan, "quickstart", run_box=local_box(make_gpu_shim(tmp_path, free_gb=75)))
    assert fails(rows) == [], text
    assert "75 GB free" in text and "2 GB of its model and this run's files it reuses" in text
    assert round(box_check.reused_gb(str(tmp_path), RUN, mine)) == 2 and box_check.reused_gb(str(tmp_path), None) == 0
    # DRL_MIN_FREE_GB, which the launch forwards to the box, holds here too
    rows, text = report(plan, "quickstart", env={"DRL_MIN_FREE_GB": "90"},
                        run_box=local_box(make_gpu_shim(tmp_path, free_gb=75)))
    assert fails(rows) == ["box.disk"] and ">= 90 GB" in text and "need 90 GB: DRL_MIN_FREE_GB" in text, text
    rows, text = report(plan, "quickstart", env={"DRL_MIN_FREE_GB": "lots"},
                        run_box=local_box(make_gpu_shim(tmp_path, free_gb=75)))
    assert fails(rows) == ["box.disk"] and "DRL_MIN_FREE_GB='lots' must be a number" in text, text


def test_box_gpu_memory_warns_before_an_out_of_memory_step(file_store, tmp_path):
    """The recipe's 16384-token micro-batches fit an 80 GB GPU (the other box tests) but not a 40 GB one:
    a warning naming the largest budget that fits, and that budget passes."""
    small = local_box(make_gpu_shim(tmp_path, "NVIDIA A100-SXM4-40GB, 40960 MiB"))
    rows, text = report(make_plan("quickstart", file_store.url, remote_dir=str(tmp_path)), "quickstart",
                        run_box=small)
    row = next(r for r in rows if r.check == "box.gpu_memory")
    assert row.status == "WARN" and fails(rows) == [], text
    assert "~66 GiB per GPU at 16384 tokens" in row.seen and "40 GiB" in row.seen
    assert "compute.max_tokens_per_gpu: 3072" in row.fix
    rows, text = report(make_plan("quickstart", file_store.url, remote_dir=str(tmp_path),
                                  overrides={"train.max_tokens_per_gpu": 3072}), "quickstart", run_box=small)
    assert next(r for r in rows if r.check == "box.gpu_memory").status == "PASS", text


def test_learner_memory_estimate_matches_the_measured_peaks():
    """The estimate against the megatron backend's peaks on an H200 (bench/results/megatron_gpu.json)."""
    import json

    from infra.learner_memory import dense_params, learner_peak_gib
    from infra.slime_launch import KNOWN_HF_CONFIGS
    from trainer.config import resolve

    measured = json.loads((Path(__file__).parent.parent / "bench/results/megatron_gpu.json").read_text())
    cfg = KNOWN_HF_CONFIGS["Qwen/Qwen2.5-1.5B-Instruct"]
    assert dense_params(cfg) == measured["params"]
    compute = resolve("gsm8k", env={}).compute
    for variant in ("megatron", "megatron@8"):
        step = measured["step"][variant]
        compute.max_tokens_per_gpu = step["rows_per_micro_batch"] * 512
        assert learner_peak_gib(cfg, compute, 384) == pytest.approx(step["peak_mem_gib"], rel=0.03), variant
    assert dense_params({**cfg, "num_experts": 32}) is None


def test_box_ray_dashboard_exposed(file_store, gpu_shim, tmp_path):
    with socket.socket() as s:
        deadline = time.monotonic() + 120  # a Ray dashboard another test (or worker) started goes away with it
        while True:
            try:
                s.bind(("0.0.0.0", 8265))
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.skip("port 8265 is in use here")
                time.sleep(1)
        s.listen()
        rows, text = report(make_plan("quickstart", file_store.url, remote_dir=str(tmp_path)), "quickstart",
                            run_box=local_box(gpu_shim))
    assert fails(rows) == ["box.ray_dashboard"], text
    assert "ray stop" in text


def test_model_identity_with_an_hf_dir(file_store, tmp_path):
    from tokenizers import Tokenizer, models

    hf = tmp_path / "hf"
    hf.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(hf / "tokenizer.json"))
    cfg = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True}
    (hf / "config.json").write_text(json.dumps(cfg))
    plan = make_plan("quickstart", file_store.url, overrides={"model.path": str(hf)})
    _publish(file_store, vocab_size=64)  # its digests ("0" * 64) are not the tokenizer's
    rows, text = report(plan, "quickstart", hf_dir=str(hf))
    assert fails(rows) == ["model.vocab_tokenizer"], text
    assert "tokenizer_digest" in text


# -- the entry point ------------------------------------------------------------------------------------
def test_piped_dry_run_through_python_m(s3_store, s3_env, tmp_path):
    plan_text = render_plan(make_plan("fleet", s3_store.url))
    env = {**s3_env, "PATH": os.environ["PATH"], "DRL_PREFLIGHT_PROFILE": "fleet", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "infra.preflight"], input="some make noise\n" + plan_text,
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "profile fleet" in out.stdout and "0 FAIL" in out.stdout
    bad = render_plan(make_plan("fleet", s3_store.url, env={"DRL_KV_MODE": "dense"}))
    out = subprocess.run([sys.executable, "-m", "infra.preflight"], input=bad, cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "FAIL  contract.kv_mode" in out.stdout
    assert TEST_SECRET_KEY not in out.stdout + out.stderr and TEST_ACCESS_KEY not in out.stdout + out.stderr


def test_no_plan_on_stdin_is_a_usage_error(capsys):
    assert main([], stdin=io.StringIO("nothing here\n"), env={}) == 2
    assert "no launch plan found" in capsys.readouterr().err


def test_json_rows(file_store, capsys):
    assert main(["--json"], stdin=io.StringIO(render_plan(make_plan("quickstart", file_store.url))),
                env={"PATH": os.environ["PATH"]}) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["profile"] == "quickstart" and all(r["status"] != "FAIL" for r in data["rows"])


def test_no_secret_in_output_even_in_errors(moto_server, tmp_path, capsys):
    env_file = tmp_path / "r2env"
    env_file.write_text(f"R2_ACCESS_KEY_ID={TEST_ACCESS_KEY}\nR2_SECRET_ACCESS_KEY={TEST_SECRET_KEY}\n"
                        f"DRL_S3_ENDPOINT={moto_server.endpoint}\n")
    env_file.chmod(0o600)
    plan = make_plan("fleet", "s3://no-such-bucket-y")
    # The bucket does not exist: the bucket check fails, and its error passes through redaction.
    code = main(["--env-file", str(env_file)], stdin=io.StringIO(render_plan(plan)),
                env={"PATH": os.environ["PATH"], "DRL_PREFLIGHT_PROFILE": "fleet"})
    captured = capsys.readouterr()
    assert code == 1 and "FAIL  bucket" in captured.out
    assert "credentials" in captured.out and "S3 keys set" in captured.out
    assert TEST_SECRET_KEY not in captured.out + captured.err and TEST_ACCESS_KEY not in captured.out + captured.err


def test_fleet_env_example_passes_out_of_the_box(moto_server, s3_store, tmp_path):
    """`set -a; . launch_fleet.env; set +a`, then the fleet preflight: only the user's own values remain."""
    example = REPO / "runs" / "psqa-decoupled" / "launch_fleet.env.example"
    env = {**moto_server.env(), "PATH": os.environ["PATH"], "HOME": str(tmp_path), "DRL_STORE": s3_store.url}
    script = f"set -a; . {example}; set +a; exec {sys.executable} -m infra.preflight --recipe psqa"
    out = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "profile fleet" in out.stdout and " 0 FAIL" in out.stdout
    for row in ("engine", "contract.kv_mode", "model.rotary_base", "bucket"):  # the native engine's rows
        assert f"PASS  {row}" in out.stdout
    sourced = subprocess.run(["bash", "-c", f"set -a; . {example}; set +a; env"], capture_output=True, text=True,
                             env={"PATH": os.environ["PATH"], "HOME": os.environ["HOME"]}).stdout
    assert "DRL_N_SAMPLES=8" in sourced and "DRL_PULSE_PLANE=int8g64" in sourced
    assert "DRL_KV_MODE=paged_prefix" in sourced and "R2_SECRET" not in sourced


def test_invoke_preflight_task(file_store):
    plan = render_plan(make_plan("quickstart", file_store.url))
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"]}
    out = subprocess.run([sys.executable, "-m", "invoke", "preflight", "--profile", "quickstart"], input=plan,
                         cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "0 FAIL" in out.stdout, out.stdout + out.stderr
    bad = render_plan(make_plan("quickstart", file_store.url, env={"DRL_N_SAMPLES": "4"}))
    out = subprocess.run([sys.executable, "-m", "invoke", "preflight"], input=bad, cwd=REPO, capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 1 and "FAIL  contract.n_samples" in out.stdout


def test_box_checks_over_real_ssh(file_store, sshd_server, tmp_path):  # noqa: F811
    """The box is this machine reached through a real sshd on loopback: no GPU here, so exactly box.gpu fails."""
    box_dir = tmp_path / "box"
    box_dir.mkdir()
    (box_dir / ".r2env").write_text("R2_BUCKET=x\n")
    (box_dir / ".r2env").chmod(0o600)
    plan = make_plan("quickstart", file_store.url, remote_dir=str(box_dir))
    rows, text = report(plan, "quickstart", host=sshd_server.host, ssh_key=str(sshd_server.client_key))
    status = {r.check: r.status for r in rows}
    disk_ok = shutil.disk_usage(box_dir).free / 1e9 >= 76  # the real df on the real box (this machine)
    assert status["box.disk"] == ("PASS" if disk_ok else "FAIL") and status["box.ray_dashboard"] in ("PASS", "FAIL")
    assert f"box {box_dir}/.r2env mode 600" in text
    if status["box.gpu"] == "PASS":
        pytest.skip("this machine has a GPU")
    assert set(fails(rows)) - {"box.disk", "box.ray_dashboard"} == {"box.gpu"}, text
    assert "nvidia-smi" in text


def test_base_anchor_present_on_a_published_run(file_store):
    from opsbucket import build_run

    build_run(file_store, RUN, pointer=3, anchor_interval=2, workers={})
    rows, text = report(make_plan("quickstart", file_store.url), "quickstart")
    row = next(r for r in rows if r.check == "base_anchor")
    assert row.status == "PASS" and row.seen == "present: v3", text


def test_fleet_model_identity_from_the_shared_base_in_the_bucket(s3_store, s3_env, tmp_path):
    """A laptop has no LFM2.5 checkpoint, but the bucket's bases/lfm25/ has its config and tokenizer."""
    import time

    from tokenizers import Tokenizer, models

    from infra.psqa_setup import BASE_NAME, BaseFile, BaseManifest

    hf = tmp_path / "hf"
    hf.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(hf / "tokenizer.json"))
    cfg = {**sl.KNOWN_HF_CONFIGS["LiquidAI/LFM2.5-8B-A1B"], "architectures": ["Lfm2MoeForCausalLM"]}
    (hf / "config.json").write_text(json.dumps(cfg))
    files = {}
    for rel in ("config.json", "tokenizer.json"):
        s3_store.upload_file(layout.base_file_key(BASE_NAME, "hf", rel), hf / rel)
        files[f"hf/{rel}"] = BaseFile(sha256="0" * 64, bytes=(hf / rel).stat().st_size)
    base = BaseManifest(name=BASE_NAME, hf_id="LiquidAI/LFM2.5-8B-A1B", files=files, created_at=time.time())
    s3_store.put(layout.base_manifest_key(BASE_NAME), base.model_dump_json().encode())
    plan = make_plan("fleet", s3_store.url)
    rows, text = report(plan, "fleet", env=s3_env)
    assert fails(rows) == [], text
    assert "bases/lfm25 in the bucket" in text
    _publish(s3_store, "fleet")  # its digests ("0" * 64) are not the tokenizer's
    rows, text = report(plan, "fleet", env=s3_env)
    assert fails(rows) == ["model.vocab_tokenizer"] and "tokenizer_digest" in text, text


def test_unreachable_box_fails_only_box_ssh(s3_store, s3_env, tmp_path):
    plan = make_plan("quickstart", s3_store.url, host="nobody@127.0.0.1:1")
    rows, text = report(plan, "quickstart", env=s3_env, ssh_key=str(tmp_path / "no-such-key"))
    status = {r.check: r.status for r in rows}
    assert fails(rows) == ["box.ssh"], text
    assert "ssh nobody@127.0.0.1:1 true" in text
    assert status["box.gpu"] == status["box.disk"] == status["box.ray_dashboard"] == "WARN"


def test_fleet_dry_run_piped_into_preflight(moto_server, s3_store, sshd_server, tmp_path):  # noqa: F811
    """The documented fleet path: source launch_fleet.env, `DRL_DRY_RUN=1 ... | preflight`. Every check of the
    launch passes; the box is this machine (through a real sshd), which is not a B200 box: only the GPU and
    disk rows may fail, and they say so."""
    example = REPO / "runs" / "psqa-decoupled" / "launch_fleet.env.example"
    key, box = str(sshd_server.client_key), tmp_path / "box"
    env = {**moto_server.env(), "PATH": os.environ["PATH"], "HOME": str(tmp_path), "DRL_STORE": s3_store.url}
    script = (f"set -a; . {example}; set +a; DRL_DRY_RUN=1 {sys.executable} -m entrypoints.launch --recipe psqa "
              f'--run "$DRL_RUN" --engine slime --host {sshd_server.host} --ssh-key {key} --remote-dir {box} '
              f"| {sys.executable} -m infra.preflight --ssh-key {key}")
    out = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    rows = {line.split()[1]: line.split()[0] for line in out.stdout.splitlines()
            if line[:4] in ("PASS", "FAIL", "WARN")}
    assert rows["box.ssh"] == "PASS", out.stdout + out.stderr
    launch_rows = {k: v for k, v in rows.items() if not k.startswith("box.")}
    assert len(launch_rows) == 16 and set(launch_rows.values()) == {"PASS"}, out.stdout + out.stderr
    assert {k for k, v in rows.items() if v == "FAIL"} <= {"box.gpu", "box.disk"}
    assert out.returncode == (1 if "FAIL" in rows.values() else 0)
    assert TEST_SECRET_KEY not in out.stdout + out.stderr


def test_quickstart_dry_run_piped_into_preflight(moto_server, s3_store, sshd_server, tmp_path):  # noqa: F811
    key = str(sshd_server.client_key)
    env = {**moto_server.env(), "PATH": os.environ["PATH"], "HOME": str(tmp_path), "DRL_STORE": s3_store.url,
           "DRL_RUN": "qs-pf-1", "DRL_PULSE_PLANE": "bf16", "DRL_DRY_RUN": "1"}
    launch = [sys.executable, "-m", "entrypoints.launch", "--recipe", "gsm8k", "--run", "qs-pf-1"]
    dry = subprocess.run([*launch, "--host", sshd_server.host, "--ssh-key", key, "--remote-dir", str(tmp_path / "b")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr
    out = subprocess.run([sys.executable, "-m", "infra.preflight", "--ssh-key", key], input=dry.stdout, cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    rows = {line.split()[1]: line.split()[0] for line in out.stdout.splitlines()
            if line[:4] in ("PASS", "FAIL", "WARN")}
    assert "profile quickstart" in out.stdout and rows["box.ssh"] == "PASS", out.stdout + out.stderr
    assert {k for k, v in rows.items() if v != "PASS"} <= {"box.gpu", "box.gpu_memory", "box.disk"}, out.stdout
    assert {"engine", "model.rotary_base", "bucket"} <= set(rows)  # the quickstart's default engine is native
    # without HOST (and no GPU here) the dry run is the embedded default: nothing to preflight, said plainly
    embedded = subprocess.run(launch, cwd=REPO, env={**env, "DRL_STORE": ""}, capture_output=True, text=True,
                              timeout=300)
    out = subprocess.run([sys.executable, "-m", "infra.preflight"], input=embedded.stdout, cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "embedded default" in out.stderr


# -- box.slime: the commit and what the patch set does there ---------------------------------------------
def _slime_git_tree(tmp_path):
    import test_patches

    from infra.patches import apply as patches

    tree = test_patches.make_tree(tmp_path, patches.load_patches())
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "slime"]):
        test_patches._git(tree, *args)
    return tree


def _slime_row(file_store, gpu_shim, tmp_path, tree):
    plan = make_plan("quickstart", file_store.url, remote_dir=str(tmp_path), overrides={"launch.slime_dir": str(tree), "train.engine": "slime"})
    rows, text = report(plan, "quickstart", run_box=local_box(gpu_shim))
    return next(r for r in rows if r.check == "box.slime"), text


def test_box_slime_names_the_commit_and_each_patch(file_store, gpu_shim, tmp_path):
    from infra.patches import apply as patches

    tree = _slime_git_tree(tmp_path)
    sha = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    row, text = _slime_row(file_store, gpu_shim, tmp_path, tree)
    assert row.status == "PASS" and sha in row.seen, text
    assert "0001-after-train-hook to apply at launch; 0002-dual-clip-epsilon to apply at launch" in row.seen
    patches.apply_patches(tree, log=lambda *_: None)
    row, text = _slime_row(file_store, gpu_shim, tmp_path, tree)
    assert row.status == "PASS" and "0001-after-train-hook patched; 0002-dual-clip-epsilon patched" in row.seen, text


def test_box_slime_upstream_fix_is_not_needed(file_store, gpu_shim, tmp_path):
    import test_patches

    tree = _slime_git_tree(tmp_path)
    test_patches._upstream_fixed(tree)
    row, text = _slime_row(file_store, gpu_shim, tmp_path, tree)
    assert row.status == "PASS" and "0002-dual-clip-epsilon not needed (slime does it)" in row.seen, text


def test_box_slime_fails_when_the_patched_hook_is_never_called(file_store, gpu_shim, tmp_path):
    from infra.patches import apply as patches
    from infra.patches import probes

    tree = _slime_git_tree(tmp_path)
    patches.apply_patches(tree, log=lambda *_: None)
    actor = tree / probes.ACTOR
    actor.write_text(actor.read_text().replace("    def train(self, rollout_id,", "    def train_old(self, rollout_id,"))
    row, text = _slime_row(file_store, gpu_shim, tmp_path, tree)
    assert row.status == "FAIL" and "has no train() method" in row.seen, text
    assert "git checkout -- slime/backends/megatron_utils/actor.py" in row.fix


def test_box_slime_missing_is_left_to_the_launch(file_store, gpu_shim, tmp_path):
    row, text = _slime_row(file_store, gpu_shim, tmp_path, tmp_path / "no-slime")
    assert row.status == "WARN" and "no slime checkout" in row.seen, text


def test_a_plan_whose_recipe_has_top_p_below_1_is_refused_in_one_line(file_store, capsys):
    """A dry run refuses top_p < 1 itself; a plan that carries it anyway (edited, or from an older tree) is
    refused by the preflight's own validation, in one line naming the key, the value and the fix."""
    plan = make_plan("quickstart", file_store.url)
    plan = plan.model_copy(update={"recipe": {**plan.recipe, "algo": {**plan.recipe["algo"], "top_p": 0.9}}})
    assert main([], stdin=io.StringIO(render_plan(plan)), env={"PATH": os.environ["PATH"]}) == 2
    err = capsys.readouterr().err
    assert "algo.top_p=0.9" in err and "top_p: 1.0" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("gpu", "status", "seen"), [
    ("NVIDIA H200, 143771 MiB", "PASS", "~123 GiB per GPU (8.3 B parameters, offload 1, no recompute"),
    ("NVIDIA H100 80GB HBM3, 81559 MiB", "WARN", "the GPU has 80 GiB"),
    ("NVIDIA B200, 183359 MiB", "PASS", "the GPU has 179 GiB")])
def test_fleet_model_gpu_memory_by_card(file_store, tmp_path, gpu, status, seen):
    """The fleet model's row estimates its peak under the recipe's memory plan (fitted to the H200 measurements:
    105.4 GiB with the whole optimizer offloaded at 17408 tokens, plus the publish snapshot: ~123 at the nominal
    18432) and names the plan that fits each card users rent, with the moments each engine keeps."""
    plan = make_plan("fleet", file_store.url, remote_dir=str(tmp_path))
    rows, text = report(plan, "fleet", run_box=local_box(make_gpu_shim(tmp_path, gpu)))
    row = next(r for r in rows if r.check == "box.gpu_memory")
    assert row.status == status and seen in row.seen, text
    assert "80 GB: none at any batch" in row.seen and "141 GB: offload 1 (~" in row.seen, row.seen
    # slime: Megatron-LM's CPU offload keeps float32 moments (its HybridDeviceOptimizer takes no moment dtype), so
    # the B200 needs more offloaded than the native engine's bf16 moments do, and the host holds 16 bytes a
    # parameter (float32 master, gradient buffer and two moments)
    assert "180 GB: offload 0.75 (~" in row.seen and "float32 moments" in row.seen, row.seen
    assert "~124 GiB of optimizer state in host memory" in row.seen, row.seen
    native = make_plan("fleet", file_store.url, remote_dir=str(tmp_path), overrides={"train.engine": "native"})
    rows, text = report(native, "fleet", run_box=local_box(make_gpu_shim(tmp_path, gpu)))
    seen = next(r for r in rows if r.check == "box.gpu_memory").seen
    assert "180 GB: offload 0.5 (~" in seen and "bfloat16 moments; ~62 GiB of optimizer state" in seen, seen
    if status == "WARN":
        assert "compute.tensor_parallel" in row.fix and "max_tokens_per_gpu: 0" not in row.fix, row.fix
