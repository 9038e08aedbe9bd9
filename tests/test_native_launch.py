"""The native engine's launch: engine selection, the box check driven by what the box reports, the on-box
steps on this machine (a short native loop on the CPU: detached learner, a reference worker, stop), and the
remote steps over the real sshd on loopback.

The box's GPU is what its `nvidia-smi` reports: a script on PATH that answers the query as a driver does
stands for the GPU check only; the learner itself runs on this machine's CPU (torch sees no CUDA).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sshd import sshd_server  # noqa: F401  (fixture)

from embedded.config import EmbeddedBaseConfig
from trainer.config import REPO_ROOT, resolve

pytestmark = pytest.mark.integration

SMI_ANSWER = "NVIDIA H200, 580.159.04, 143771"


def fake_smi_dir(root: Path) -> Path:
    """A directory holding an `nvidia-smi` that reports one H200 (the box's own report, as the driver's)."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$*\" in *query-gpu=index*) echo '0, NVIDIA H200, 0, 1024, 143771';; "
                   f"*) echo '{SMI_ANSWER}';; esac\n")
    smi.chmod(0o755)
    return bin_dir


def _python_with(root: Path, files: dict[str, str]) -> str:
    """A Python with `files` first on its path (a box's image, as it differs from this venv), as a wrapper."""
    for rel, text in files.items():
        (root / "path" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "path" / rel).write_text(text)
    wrapper = root / "python-box"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={root / 'path'}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def python_hiding(root: Path, modules: list[str]) -> str:
    """A Python on which `modules` are not installed (a box whose image lacks them): its import system
    finds none of them."""
    hidden = tuple(m.split(".")[0] for m in modules)
    return _python_with(root, {"sitecustomize.py": (
        f"import sys\nHIDDEN = {hidden!r}\n\n\nclass Hide:\n    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        "        if name.split('.')[0] in HIDDEN:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n\n\n"
        "sys.meta_path.insert(0, Hide)\n")})


def test_engine_per_recipe_and_from_the_command_line():
    assert resolve("gsm8k", {}, {"run": "e-1"}).train.engine == "native"
    assert resolve("psqa", {}, {"run": "e-1"}).train.engine == "native"  # measured to fit one H200
    assert resolve("psqa", {}, {"run": "e-1", "train.engine": "slime"}).train.engine == "slime"
    assert resolve("gsm8k", {}, {"run": "e-1", "train.engine": "slime"}).train.engine == "slime"
    with pytest.raises(ValueError, match="engine"):
        resolve("gsm8k", {}, {"run": "e-1", "train.engine": "nemo"})


def test_dry_run_shows_the_engine_and_its_steps(monkeypatch):
    from entrypoints.launch import launch

    for engine, must in (("native", ["entrypoints.learner", "wait_learner", "install_packages"]),
                         ("slime", ["train.py", "apply_patches", "convert_model"])):
        lines: list[str] = []
        env = {"DRL_DRY_RUN": "1", "DRL_STORE": "s3://stoa-test", "PATH": os.environ["PATH"]}
        rc = launch(["--recipe", "gsm8k", "--run", "dry-engine-1", "--host", "root@203.0.113.7",
                     "--engine", engine], env=env, out=lines.append)
        text = "\n".join(lines)
        assert rc == 0, text
        assert f"engine: {engine}" in text
        for m in must:
            assert m in text, (engine, m)
    lines = []
    rc = launch(["--recipe", "gsm8k", "--run", "dry-engine-1", "--engine", "nemo"], env={"DRL_DRY_RUN": "1"},
                out=lines.append)
    assert rc == 2


def test_native_box_check_follows_what_the_box_reports(tmp_path, monkeypatch):
    from infra import box_check

    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no driver on this PATH
    report = box_check.run_checks(str(tmp_path), "/nonexistent", "/nonexistent", min_free_gb=0.0, engine="native")
    assert report["ok"] is False and "nvidia-smi: not found" in report["gpu"]["error"]
    assert "slime" not in report["gpu"]["error"]  # the native engine needs no slime image
    monkeypatch.setenv("PATH", f"{fake_smi_dir(tmp_path)}:/usr/bin:/bin")
    report = box_check.run_checks(str(tmp_path), "/nonexistent", "/nonexistent", min_free_gb=0.0, engine="native")
    assert report["ok"] is True, report
    assert report["gpu"]["gpus"] == [{"name": "NVIDIA H200", "driver": "580.159.04", "memory_mib": 143771}]
    assert report["imports"]["installable"] == []  # this venv has megatron-core and ray
    # a plain PyTorch image: megatron-core and ray are installed by the launch, not required of the image
    hidden = box_check.check_native_imports(python_hiding(tmp_path / "a", ["megatron.core", "ray"]))
    assert hidden == {"ok": True, "installable": ["megatron-core>=0.16.1", "ray[default]>=2.40"]}
    # an image without transformers (or torch) is refused, naming it
    bad = box_check.check_native_imports(python_hiding(tmp_path / "b", ["transformers", "ray"]))
    assert bad["ok"] is False and "cannot import transformers" in bad["error"] and "ray" not in bad["error"]
    # megatron-core and ray are looked for, not imported (an import of megatron-core alone takes seconds, and
    # pip would not reinstall one that is installed and fails): one that raises on import counts as present
    broken = _python_with(tmp_path / "c", {"megatron/core/__init__.py": "raise RuntimeError('imported')\n"})
    assert box_check.check_native_imports(broken) == {"ok": True, "installable": []}
    assert box_check.ensure_deps(["megatron-core>=0.16.1"], python=broken) == []


def test_the_box_check_holds_the_box_to_the_recipes_disk_figure(tmp_path, monkeypatch):
    """The launch's box check asked for 100 GB whatever the recipe (the psqa recipe needs 172 on the native
    engine, 272 on slime): it now asks for the figure the preflight's box.disk computes, over SSH too."""
    from infra.native_launch import step_check_box
    from infra.remote import deploy
    from infra.slime_launch import BoxPaths
    from infra.steps import StepFailed

    for recipe, engine, gb in (("gsm8k", "native", 67), ("psqa", "native", 172), ("psqa", "slime", 272)):
        assert deploy._disk_floor(resolve(recipe, env={}, overrides={"train.engine": engine})) == gb
    monkeypatch.delenv("DRL_MIN_FREE_GB", raising=False)
    monkeypatch.setenv("PATH", f"{fake_smi_dir(tmp_path)}:/usr/bin:/bin")
    huge = resolve("psqa", env={"DRL_RUN": "disk-1"}, overrides={"checkpoint.keep": 100_000})
    with pytest.raises(StepFailed, match=r"need about \d{7,} GB"):
        step_check_box(huge, BoxPaths(remote_dir=str(tmp_path), run="disk-1"))
    monkeypatch.setenv("DRL_MIN_FREE_GB", "0")  # the override still wins, for a box small on purpose
    assert "GB free" in step_check_box(huge, BoxPaths(remote_dir=str(tmp_path), run="disk-1"))
    # set on the user's machine it holds over SSH too: the remote check and the on-box launch get it
    monkeypatch.setenv("DRL_MIN_FREE_GB", "5")
    launch = deploy.RemoteLaunch(conn=None, host="root@box", cfg=huge, recipe_file="/root/dRL/r.json",
                                 repo_root=REPO_ROOT)
    assert deploy._disk_floor(huge) == 5.0 and "DRL_MIN_FREE_GB=5 " in launch.box_command()
    monkeypatch.setenv("DRL_MIN_FREE_GB", "lots")
    with pytest.raises(ValueError, match="DRL_MIN_FREE_GB='lots' must be a number"):
        deploy._disk_floor(huge)
    # on the box, as the launch runs it or by hand: the same sentence, not float()'s traceback; a negative
    # value is no way to turn the check off
    with pytest.raises(ValueError, match="DRL_MIN_FREE_GB='lots' must be a number"):
        step_check_box(huge, BoxPaths(remote_dir=str(tmp_path), run="disk-1"))
    for value in ("lots", "-5"):
        r = subprocess.run([sys.executable, str(REPO_ROOT / "infra" / "box_check.py"), "--remote-dir", str(tmp_path),
                            "--engine", "native"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "DRL_MIN_FREE_GB": value})
        assert r.returncode == 2 and r.stderr.strip() == (f"box check: DRL_MIN_FREE_GB={value!r} must be a number "
                                                          "of GB at least 0 (e.g. DRL_MIN_FREE_GB=50)"), r.stderr


def test_the_join_hint_of_a_search_run_names_the_retriever_url():
    """A psqa card without DRL_RETRIEVER_URL cannot seat a light-tier Mac: the launcher's last line says how
    to print the card with the shared retriever in it; a gsm8k run's does not ask for one."""
    from infra.native_launch import join_hint

    psqa = join_hint(resolve("psqa", {}, {"run": "p1"}))
    assert "invoke joincard --run p1 --retriever-url http://" in psqa
    assert "--retriever-url" not in join_hint(resolve("gsm8k", {}, {"run": "g1"}))


def test_install_step_installs_nothing_that_imports():
    from infra.native_launch import step_install_packages

    assert step_install_packages(sys.executable) == "megatron-core and ray present"


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> str:
    from embedded.basemodel import ensure_base
    from worker_contract.tasks import get_task

    cfg = EmbeddedBaseConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                             vocab_size=300, tokenizer_corpus=200, sft_steps=2, sft_batch_size=4)
    return ensure_base(cfg, get_task("arithmetic"), tmp_path_factory.mktemp("base"), max_new_tokens=8,
                       eval_problems=4, log=lambda _: None).path


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_native_loop_on_cpu(tmp_path, monkeypatch, tiny_base):
    """`make gsm8k` on a (reported) GPU box with the native engine: every on-box step, the detached learner
    (the hf backend: megatron needs CUDA) trains on a reference worker's groups; `stop` ends it after a
    checkpoint; a second launch resumes (run.json identical) and the learner's new anchor moves the pointer."""
    from embedded.localprocs import Processes
    from infra import boxops
    from infra.launch_gpu import launch_on_this_box
    from infra.slime_launch import BoxPaths
    from worker_contract.manifest import load_manifest
    from worker_contract.signing import fingerprint
    from worker_contract.store import open_store

    monkeypatch.setenv("PATH", f"{fake_smi_dir(tmp_path)}:{os.environ['PATH']}")
    monkeypatch.setenv("DRL_MIN_FREE_GB", "0")
    monkeypatch.setenv("DRL_RAY_DASHBOARD", "0")
    run = f"native-cpu-{os.getpid()}"
    store_url = f"file://{tmp_path / 'bucket'}"
    cfg = resolve("gsm8k", {}, {"run": run, "model.path": tiny_base, "store": store_url, "task": "arithmetic",
                                "algo.max_new_tokens": 8, "algo.groups_per_step": 2, "train.max_tokens_per_gpu": None,
                                "train.backend": "hf",  # megatron needs CUDA; the launch is the same
                                "train.micro_batch_size": 16, "train.poll_interval_s": 0.2, "train.num_steps": 1000})
    paths = BoxPaths(remote_dir=str(REPO_ROOT), run=run)
    procs = Processes()
    try:
        lines: list[str] = []
        assert launch_on_this_box(cfg, out=lines.append, err=lines.append) == 0, "\n".join(lines)
        text = "\n".join(lines)
        for step in ("check_box", "install_packages", "write_recipe", "download_model", "publish_run",
                     "launch_learner", "wait_learner"):
            assert f"] {step}: " in text, (step, text)
        assert "NVIDIA H200" in text and "waits for rollouts" in text
        store = open_store(store_url)
        manifest = load_manifest(store, run)
        env = {**os.environ, "DRL_N_SAMPLES": "8", "DRL_PULSE_PLANE": "bf16", "CUDA_VISIBLE_DEVICES": "",
               "DRL_TRAINER_KEY_FINGERPRINT": fingerprint(manifest.trainer_public_key)}
        procs.start("worker", [sys.executable, "-m", "worker_contract.worker", "--store", store_url, "--run", run,
                               "--model", tiny_base, "--worker-id", "w1", "--threads", "1"], env,
                    tmp_path / "worker.log")
        metrics = Path(paths.state_dir) / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not [r for r in _rows(metrics) if "train/grad_norm" in r]:
            assert time.monotonic() < deadline, boxops.tail(paths.log_file, 30)
            assert boxops.alive_pid(paths.pid_file) is not None, boxops.tail(paths.log_file, 30)
            time.sleep(1)
        # the learner has trained on the worker's groups: the worker would only go on sampling (a core) through
        # the second launch and the stop, which need no more steps (stop checkpoints the step it has)
        procs.stop(timeout_s=20)
        st = boxops.status(str(REPO_ROOT), run)
        assert st["alive"] is True
        again = []  # the same launch while the learner runs: every step finds its work done
        assert launch_on_this_box(cfg, out=again.append, err=again.append) == 0, "\n".join(again)
        assert "learner already running" in "\n".join(again)
        out = boxops.stop(str(REPO_ROOT), run, timeout_s=120, log=lambda _: None)
        assert out["stopped"] is True and boxops.alive_pid(paths.pid_file) is None
        log = Path(paths.log_file).read_text()
        assert "learner_done" in log
        ckpts = sorted((Path(paths.state_dir) / "checkpoints").glob("step-*"))
        assert ckpts, "stop must leave a checkpoint"
        row = [r for r in _rows(metrics) if "train/grad_norm" in r][0]
        assert {"learner/wait_s", "publish/blocking_s"} <= row.keys()
    finally:
        procs.stop(timeout_s=20)
        if boxops.alive_pid(paths.pid_file) is not None:
            boxops.stop(str(REPO_ROOT), run, timeout_s=10, log=lambda _: None)
        shutil.rmtree(paths.state_dir, ignore_errors=True)
        Path(paths.log_file).unlink(missing_ok=True)


def test_native_launch_over_ssh(sshd_server, tmp_path, monkeypatch):  # noqa: F811
    """HOST= with the native engine: the box check runs on the box before anything travels (its GPU as its
    nvidia-smi reports it), then the tree, the credentials, the packages and the recipe, then the on-box
    sequence, whose own check fails here when the box's Python lacks the driver on its PATH."""
    from infra.remote import launch_remote

    creds = {"R2_ACCOUNT_ID": "acct0123", "R2_ACCESS_KEY_ID": "AKIDNATIVE42", "R2_SECRET_ACCESS_KEY": "sk-NATIVE-9f8e",
             "R2_BUCKET": "stoa-test"}
    for k, v in creds.items():
        monkeypatch.setenv(k, v)
    remote = tmp_path / "box" / "dRL"
    # the box's python3: the driver on its PATH for the remote check only (the on-box check runs later
    # through the same interpreter without it, so the sequence must stop there, reporting the box's error)
    smi = fake_smi_dir(tmp_path)
    py = tmp_path / "python3-box"
    py.write_text("#!/bin/sh\nexport DRL_MIN_FREE_GB=0\n"
                  f"case \"$*\" in *--engine*) PATH={smi}:$PATH exec {sys.executable} \"$@\";; esac\n"
                  f"exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    monkeypatch.setenv("DRL_MIN_FREE_GB", "0")
    cfg = resolve("gsm8k", env={"DRL_RUN": "native-ssh-1"})
    lines: list[str] = []
    rc = launch_remote(cfg, host=sshd_server.host, ssh_key=str(sshd_server.client_key), remote_dir=str(remote),
                       out=lines.append, python=str(py))
    text = "\n".join(lines)
    assert rc == 1, text
    for step in ("connect", "check_box", "ship_tree", "ship_credentials", "install_deps", "write_recipe"):
        assert f"] {step}: " in text, (step, text)
    assert "NVIDIA H200" in text
    assert "box_launch FAILED" in text and "[1/7] check_box FAILED" in text and "nvidia-smi: not found" in text
    assert (remote / ".r2env").exists() and (remote / "infra" / "native_launch.py").exists()
    assert creds["R2_SECRET_ACCESS_KEY"] not in text and creds["R2_ACCESS_KEY_ID"] not in text


def test_preflight_of_a_native_plan_checks_the_recipe_not_slime_flags(tmp_path):
    """The native plan has no slime flags: the preflight's `engine` row checks the recipe's objective values
    against the profile instead, and fails when one differs."""
    from infra.launch_gpu import build_plan
    from infra.launch_plan import parse_plan, render_plan
    from infra.preflight import build_context, run_checks

    url = f"file://{tmp_path / 'bucket'}"
    contract = {"DRL_RUN": "pf-native-1", "DRL_N_SAMPLES": "8", "DRL_STORE": url, "DRL_PULSE_PLANE": "bf16"}
    for overrides, status in (({}, "PASS"), ({"algo.reuse_cap": 3}, "FAIL")):
        cfg = resolve("gsm8k", contract, overrides)
        plan = parse_plan(render_plan(build_plan(cfg, host=None, remote_dir="/root/dRL", env=contract, store=url)))
        rows = run_checks(build_context(plan, profile="quickstart", env={"PATH": os.environ["PATH"]}))
        by = {r.check: r for r in rows}
        assert by["engine"].status == status, by["engine"]
        assert [r.check for r in rows if r.status == "FAIL"] == ([] if status == "PASS" else ["engine"])
        assert "recipe.dppo_gate" not in by and "contract.agree" not in by


@pytest.mark.parametrize("overrides, bad", [({}, None), ({"checkpoint.interval": 5}, "checkpoint.interval"),
                                            ({"algo.eps_clip_high": 5}, "algo.eps_clip_high")])
def test_the_fleet_preflight_holds_a_native_launch_to_every_pinned_value(tmp_path, overrides, bad):
    """The fleet recipe pins its save interval and dual clip (slime flags on slime): on the native engine the
    `engine` row compares the same recipe keys, so a launch that moves one is refused there too."""
    from infra.launch_gpu import build_plan
    from infra.launch_plan import parse_plan, render_plan
    from infra.preflight import build_context, run_checks

    url = f"file://{tmp_path / 'bucket'}"
    contract = {"DRL_RUN": "pf-fleet-1", "DRL_N_SAMPLES": "8", "DRL_STORE": url, "DRL_PULSE_PLANE": "int8g64",
                "DRL_KV_MODE": "paged_prefix"}
    cfg = resolve("psqa", contract, overrides)
    plan = parse_plan(render_plan(build_plan(cfg, host=None, remote_dir="/root/dRL", env=contract, store=url)))
    row = {r.check: r for r in run_checks(build_context(plan, profile="fleet", env={"PATH": os.environ["PATH"]}))}
    row = row["engine"]
    assert row.status == ("PASS" if bad is None else "FAIL"), row
    assert "checkpoint.interval=4" in row.required and "algo.eps_clip_high=19" in row.required
    if bad:
        assert f"set {bad} as required" in row.fix, row
