"""A worker joining a psqa run (tiny LFM2-MoE, the real BM25 retriever on 127.0.0.1): it uploads groups of
search episodes the learner's source accepts, drops a group with a counted reason and keeps running when the
retriever fails, and a light-tier worker with no DRL_RETRIEVER_URL is refused in one line with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from infra.retriever.corpus import synthetic_corpus
from infra.retriever.index import BM25Index
from infra.retriever.server import make_server
from tests.episode_fixtures import save_search_model
from tests.worker_fixtures import publish_run
from worker_contract import layout
from worker_contract.schema import decode_record
from worker_contract.store.file import FileStore

REPO = Path(__file__).resolve().parent.parent
RUN = "psqa-run"
N = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_search_model(tmp_path_factory.mktemp("lfm2moe"), "lfm2_moe")


@pytest.fixture(scope="module")
def psqa_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("psqa")
    rows = [{"question": f"which gene does protein {i} bind", "answer": "dmd", "golden_answers": ["dmd"]}
            for i in range(20)]
    for split in ("train", "test"):
        (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    d = tmp_path_factory.mktemp("idx")
    BM25Index.build(synthetic_corpus(60, seed=5), source="generated").save(d)
    srv = make_server(BM25Index.load(d), "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def run_store(tmp_path, model_dir, psqa_dir, monkeypatch):
    monkeypatch.setenv("DRL_PSQA_DIR", str(psqa_dir))
    store = FileStore(tmp_path / "bucket")
    cfg, manifest, _, _ = publish_run(store, model_dir, RUN, n_samples=N, max_new_tokens=48, task="psqa",
                                      kv_mode="paged_prefix")
    return store, (cfg, manifest)


def _worker(store, model_dir, **over):
    from worker_contract.worker.loop import Worker, WorkerSettings

    settings = WorkerSettings(store=store.url, run=RUN, model_dir=str(model_dir), worker_id="w1", seed=0,
                              threads=1, **over)
    return Worker(settings, env={"DRL_N_SAMPLES": str(N), "DRL_PULSE_PLANE": "bf16"})


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_uploads_search_episode_groups_the_source_accepts(run_store, model_dir, retriever, backend, caplog):
    if backend == "mlx":
        pytest.importorskip("mlx_lm", reason="the MLX worker needs mlx-lm")
    from trainer.rollouts.pool import BatchRules, RecordRules
    from trainer.rollouts.source import RolloutSource

    store, (cfg, manifest) = run_store
    caplog.set_level("INFO", logger="worker")
    w = _worker(store, model_dir, retriever_url=retriever.url, retriever_tier="light", max_groups=3, backend=backend)
    stats = w.run(threading.Event())
    assert stats.groups == 3 and not stats.dropped
    from trainer.session import model_route_shape

    shape = model_route_shape(model_dir)  # an LFM2-MoE: the records carry its routes
    src = RolloutSource(store, RecordRules.from_manifest(manifest, cfg.algo, routes=shape),
                        BatchRules(groups_per_step=3, reuse_cap=2))
    assert src.poll(1) == 3 and sum(src.drops.values()) == 0, src.drops
    records = [decode_record(store.get(k)) for k in store.list_keys(layout.rollouts_prefix(RUN))]
    for r in records:
        assert r.task == "psqa" and len(r.samples) == N
        assert r.schema_version == 2 and r.routes.layers == shape.layers
        for s in r.samples:
            assert all(lp == 0.0 for lp, m in zip(s.behavior_logprobs, s.loss_mask, strict=True) if m == 0)
    assert stats.prefill_extend <= stats.prefill_reprefill
    from bench.psqa_gpu import _WAIT  # the last line says what bench/psqa_gpu.py reads of it

    last = [r.getMessage() for r in caplog.records if "stopping:" in r.getMessage()][-1]
    m = _WAIT.search(last)
    assert m and int(m[4]) == stats.searches and float(m[5]) == pytest.approx(stats.search_s, abs=0.06), last
    print(f"{stats.searches} searches; prefill tokens {stats.prefill_extend} extended vs "
          f"{stats.prefill_reprefill} re-prefilled from the start")


@pytest.mark.parametrize("fault", ["down", "not-http", "malformed", "huge"])
def test_a_failing_retriever_drops_groups_and_the_worker_goes_on(run_store, model_dir, retriever, fault):
    """Down, answering bytes that are no HTTP, JSON that is not the wire format, a 64 MiB body: each group
    that searched is dropped and counted, the worker keeps sampling (the fault servers of
    tests/test_retriever_faults.py, in front of the real retriever)."""
    import socket

    from tests.test_retriever_faults import Faults

    store, _ = run_store
    srv = None
    if fault == "down":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}"
    else:
        srv = Faults(retriever.url, fault)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = srv.url
    w = _worker(store, model_dir, retriever_url=url, retriever_tier="heavy", retriever_timeout_s=0.5)
    stop = threading.Event()
    t = threading.Thread(target=w.run, args=(stop,), daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while w.stats.dropped.get("retriever", 0) < 2 and time.monotonic() < deadline:
        assert t.is_alive()
        time.sleep(0.2)
    assert w.stats.dropped["retriever"] >= 2 and t.is_alive()
    stop.set()
    t.join(60)
    assert not t.is_alive()  # groups where no sample searched still upload
    # read once the worker stopped: a batch's drop is counted before its sampling time is (its `finally`)
    assert 0 < w.stats.search_s <= w.stats.sampling_s  # the failed calls' wait is counted, inside sampling time
    if srv is not None:
        srv.shutdown()
        srv.server_close()


def test_a_light_tier_worker_without_a_retriever_is_refused_in_one_line(run_store, model_dir, psqa_dir):
    store, _ = run_store
    env = {k: v for k, v in os.environ.items() if k != "DRL_RETRIEVER_URL"}
    env.update(PYTHONPATH=str(REPO), DRL_N_SAMPLES=str(N), DRL_PULSE_PLANE="bf16", DRL_PSQA_DIR=str(psqa_dir))
    out = subprocess.run([sys.executable, "-m", "worker_contract.worker", "--store", store.url, "--run", RUN,
                          "--model", str(model_dir), "--retriever-tier", "light", "--wait", "5"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "DRL_RETRIEVER_URL" in last and "Traceback" not in out.stderr, out.stderr


def _cli(store, model_dir, env_over: dict, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRL_RETRIEVER")}
    env.update(PYTHONPATH=str(REPO), DRL_N_SAMPLES=str(N), DRL_PULSE_PLANE="bf16", **env_over)
    return subprocess.run([sys.executable, "-m", "worker_contract.worker", "--store", store.url, "--run", RUN,
                           "--model", str(model_dir), "--wait", "5", *args],
                          env=env, capture_output=True, text=True, timeout=120)


def test_missing_task_data_is_refused_before_any_weights_are_fetched(run_store, model_dir, retriever, tmp_path):
    """A Mac without the psqa questions (no `datasets`, no DRL_PSQA_DIR split) hears so before it downloads
    the run's weights, not after."""
    store, _ = run_store
    (tmp_path / "empty").mkdir()
    out = _cli(store, model_dir, {"DRL_PSQA_DIR": str(tmp_path / "empty"), "DRL_RETRIEVER_URL": retriever.url},
               "--retriever-tier", "medium")
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "DRL_PSQA_DIR" in last and "train.jsonl" in last and "Traceback" not in out.stderr, out.stderr
    assert "joined run" not in out.stderr, out.stderr  # refused before the cold join


@pytest.mark.parametrize("url", ["http://", "http://:8000", "https:///search", "http://host:port"])
def test_a_retriever_url_without_a_host_is_refused_in_one_sentence(run_store, model_dir, psqa_dir, url):
    """Not a URL any search could reach: refused up front (exit 2), not joined to drop every group."""
    store, _ = run_store
    out = _cli(store, model_dir, {"DRL_PSQA_DIR": str(psqa_dir), "DRL_RETRIEVER_URL": url},
               "--retriever-tier", "medium")
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert f"DRL_RETRIEVER_URL={url!r}" in last and "Traceback" not in out.stderr, out.stderr
    assert "joined run" not in out.stderr and "[type=" not in last, out.stderr


@pytest.mark.parametrize("args, says", [(["--max-turns", "0"], "argument --max-turns: 0 is out of range: give a number at least 1"),
                                         (["--retriever-tier", "big"], "--retriever-tier='big' must be one of auto, light, medium, heavy")])
def test_a_bad_psqa_setting_reads_as_one_sentence(args, says):
    """pydantic's folded table ('1 validation error for WorkerSettings; ...; [type=..., input_value=...]') is
    not a sentence: the field, what is wrong, and what was given."""
    out = subprocess.run([sys.executable, "-m", "worker_contract.worker", "--store", "file:///nonexistent", "--run",
                          RUN, *args], env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=60)
    # one sentence: the whole message, or argparse's usage then its one error line (a flag's own range check)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and (len(out.stderr.strip().splitlines()) == 1 or last.startswith("python -m")), out.stderr
    assert says in last and "[type=" not in out.stderr and "validation error" not in out.stderr, out.stderr


def test_the_documented_mac_install_brings_the_questions_a_worker_samples():
    """A worker reads the run's training questions (the real GSM8K / PaperSearchQA through `datasets`, or a
    DRL_*_DIR copy): the install line a Mac is given must bring `datasets`, or the join card's commands are
    refused at the first step."""
    import re
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for doc in ("docs/mac-worker.md", "runs/psqa-decoupled/REPRODUCE.md"):
        lines = re.findall(r"pip install -e '\.\[([a-z,]+)\]'([^\n`&|]*)", (REPO / doc).read_text())
        mac = [(names.split(","), rest) for names, rest in lines if "mlx" in names.split(",")]
        assert mac, doc
        for names, rest in mac:
            deps = [d for n in names for d in extras[n]] + rest.split()
            assert any(d.startswith("datasets") for d in deps), (doc, names, rest)


def test_a_mac_builds_and_serves_its_own_index_with_only_what_it_installs(tmp_path):
    """Medium and heavy Macs may serve a local index. A Mac installs '.[mlx,data]' and '.[retriever]', not the
    trainer's tools (invoke, fabric, torch): the documented commands are `python -m infra.retriever build`
    and `serve`, which run with those tools missing, and no Mac command block calls invoke."""
    import re

    from infra.retriever.corpus import write_jsonl
    from worker_contract.tasks.psqa_retrieval import RetrieverClient

    for doc in ("docs/mac-worker.md", "runs/psqa-decoupled/REPRODUCE.md"):
        blocks = [b for b in re.findall(r"```bash\n(.*?)```", (REPO / doc).read_text(), re.S)
                  if "worker_contract.worker --backend mlx" in b]
        assert blocks and not [line for b in blocks for line in b.splitlines() if "bin/invoke" in line], doc
        assert any("python -m infra.retriever build" in b and "python -m infra.retriever serve" in b
                   for b in blocks), doc
    without = ("import runpy, sys\nfor m in ('invoke', 'fabric', 'torch', 'ray', 'matplotlib'): sys.modules[m] = None\n"
               "runpy.run_module('infra.retriever', run_name='__main__', alter_sys=True)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    corpus = write_jsonl(synthetic_corpus(40, seed=3), tmp_path / "corpus.jsonl")
    built = subprocess.run([sys.executable, "-c", without, "build", "--corpus", str(corpus), "--out",
                            str(tmp_path / "idx")], env=env, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    serve = subprocess.Popen([sys.executable, "-c", without, "serve", "--index", str(tmp_path / "idx"), "--port", "0"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        for line in serve.stdout:
            found = re.search(r"serving (http://127\.0\.0\.1:\d+)", line)
            if found:
                url = found.group(1)
                break
        assert url and RetrieverClient(url).health().documents == 40
    finally:
        serve.terminate()
        serve.wait(30)


def test_the_tier_follows_the_machine_memory_and_the_flag_overrides_it(run_store, model_dir, psqa_dir):
    """light below 24 GB (the 16-24 GB Macs), medium below 48, heavy above; auto reads the machine's physical
    memory; --retriever-tier, else DRL_RETRIEVER_TIER, overrides it. Seen through the refusal each tier gives
    a worker with no retriever URL."""
    import re

    from worker_contract.worker.retrieval import GB, machine_memory_bytes, resolve_tier, tier_for

    assert [tier_for(int(g * GB)) for g in (0, 15, 23.9, 24, 47.9, 48, 192)] == \
        ["light"] * 3 + ["medium"] * 2 + ["heavy"] * 2
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        total = int(re.search(r"MemTotal:\s+(\d+) kB", meminfo.read_text())[1]) * 1024
        assert abs(machine_memory_bytes() - total) < 0.05 * total
    auto = resolve_tier("auto")
    assert auto == tier_for(machine_memory_bytes())
    store, _ = run_store
    for args, env, tier in (([], {}, auto), (["--retriever-tier", "heavy"], {}, "heavy"),
                            ([], {"DRL_RETRIEVER_TIER": "light"}, "light"),
                            (["--retriever-tier", "medium"], {"DRL_RETRIEVER_TIER": "light"}, "medium")):
        out = _cli(store, model_dir, {"DRL_PSQA_DIR": str(psqa_dir), **env}, *args)
        last = out.stderr.strip().splitlines()[-1]
        assert out.returncode == 2 and "DRL_RETRIEVER_URL" in last, (args, env, out.stderr)
        said = "light" if "light-tier worker cannot hold" in last else re.search(r"this (\w+)-tier machine", last)[1]
        assert said == tier, (args, env, last)


def test_the_task_says_how_it_is_sampled():
    """The worker and the learner read a task's kind from its hooks, so a new task needs no edit outside it."""
    from worker_contract.tasks import TASKS, get_task

    assert {n for n in TASKS if get_task(n).multi_turn} == {"psqa"}
    assert {n for n in TASKS if "retriever" in get_task(n).services} == {"psqa"}
    assert get_task("gsm8k").batch_metrics([]) == {}
