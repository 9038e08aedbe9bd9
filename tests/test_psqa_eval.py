"""Held-out PaperSearchQA evaluation: exact metrics on a scripted policy, stop-string cutting, and the
whole CLI on a tiny LFM2-MoE checkpoint built on the spot against a real retriever on 127.0.0.1."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from trainer import psqa_eval
from worker_contract.tasks.psqa import PsqaProblem, PsqaTask, TurnOutput

REPO = Path(__file__).resolve().parent.parent


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    text = ["<search> dystrophin gene </search> <answer> DMD </answer> <information> Doc </information>"] * 20
    t.train_from_iterator(text, trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<eos>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", pad_token="<pad>",
                                   chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}A:")


def _tiny_lfm2_moe(path: Path, layer_types: list[str]):
    """A random LFM2-MoE of the test tokenizer, saved with it under `path` (an HF directory); returns the model."""
    import torch
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    torch.manual_seed(0)
    tok = _tokenizer()
    cfg = Lfm2MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2,
                        num_dense_layers=1, num_experts=4, num_experts_per_tok=2, layer_types=layer_types,
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = Lfm2MoeForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def _test_split(tmp_path: Path) -> Path:
    """A data directory holding three held-out questions (test.jsonl)."""
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"question": f"Which gene {i}?", "answer": "dystrophin", "golden_answers": ["dystrophin"]} for i in range(3)]
    (data / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return data


@pytest.fixture
def retriever():
    """A real BM25 retriever on 127.0.0.1 over a small generated corpus."""
    from infra.retriever.corpus import synthetic_corpus
    from infra.retriever.index import BM25Index
    from infra.retriever.server import make_server

    srv = make_server(BM25Index.build(synthetic_corpus(40)), "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_metrics_on_a_scripted_policy():
    tok = _tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    # problem 0: samples 0 and 1 search then answer right, 2 and 3 answer wrong at once; problem 1: all wrong
    plan = {0: ["<search> q </search>", "<answer> DMD </answer>"], 1: ["<search> q </search>", "<answer>dmd</answer>"],
            2: ["<answer> utrophin </answer>"], 3: ["<answer> x </answer>"]}
    turns: dict[tuple[str, int], int] = {}

    def generate_batch(contexts, budgets):
        outs = []
        for row, ctx in enumerate(contexts):
            problem = "q0" if "Question: q0" in tok.decode(ctx) else "q1"
            turn = turns.get((problem, row), 0)
            turns[(problem, row)] = turn + 1
            text = plan[row][turn] if problem == "q0" else "<answer> nope </answer>"
            ids = enc(text)
            outs.append(TurnOutput(ids, [-0.1] * len(ids), text, False))
        return outs

    problems = [PsqaProblem(id=f"psqa-test-{i}", question=f"q{i}", answer="DMD", golden_answers=("DMD",)) for i in range(2)]
    encode_prompt = lambda msgs: enc(msgs[0]["content"])  # noqa: E731

    point = psqa_eval.evaluate(problems, PsqaTask(), encode_prompt, generate_batch, enc, lambda q: "Doc 1",
                               k=4, max_new_tokens=200, max_turns=2, version=7)
    assert point.version == 7 and point.questions == 2 and point.k == 4
    assert point.pass1 == pytest.approx((2 / 4 + 0) / 2)
    assert point.pass_k == pytest.approx((1.0 + 0.0) / 2)
    assert point.search_rate == pytest.approx((2 / 4 + 0) / 2)
    assert point.searches_per_episode == pytest.approx(0.25)


def test_questions_batched_together_score_as_one_at_a_time():
    tok = _tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    # each question's policy depends on its own context only: q0 searches then answers right, q1 answers
    # wrong at once, q2 answers right at once, q3 searches then answers wrong
    def generate_batch(contexts, budgets):
        outs = []
        for ctx in contexts:
            text = tok.decode(ctx)
            q = next(i for i in range(4) if f"Question: q{i}" in text)
            searched = "Doc 1" in text
            reply = {0: "<answer> DMD </answer>" if searched else "<search> q </search>",
                     1: "<answer> nope </answer>", 2: "<answer> DMD </answer>",
                     3: "<answer> x </answer>" if searched else "<search> q </search>"}[q]
            ids = enc(reply)
            outs.append(TurnOutput(ids, [-0.1] * len(ids), reply, False))
        return outs

    problems = [PsqaProblem(id=f"psqa-test-{i}", question=f"q{i}", answer="DMD", golden_answers=("DMD",)) for i in range(4)]
    encode_prompt = lambda msgs: enc(msgs[0]["content"])  # noqa: E731
    points = [psqa_eval.evaluate(problems, PsqaTask(), encode_prompt, generate_batch, enc, lambda q: "Doc 1", k=2,
                                 max_new_tokens=200, max_turns=2, version=1, questions_per_batch=b).model_dump()
              for b in (1, 3, 16)]
    for p in points:
        p.pop("seconds")
    assert points[0] == points[1] == points[2]
    assert points[0]["pass1"] == pytest.approx(0.5) and points[0]["search_rate"] == pytest.approx(0.5)
    assert points[0]["correct_after_search"] == pytest.approx(0.5)


def test_cut_at_stop():
    tok = _tokenizer()
    ids = tok.encode("<think> x </think><search> dystrophin </search> junk after", add_special_tokens=False)
    dec = lambda i: tok.decode(i)  # noqa: E731
    cut = psqa_eval.cut_at_stop(dec, ids, 0, ("</search>", "</answer>"))
    assert dec(ids[:cut]).endswith("</search>") and "junk" not in dec(ids[:cut])
    assert psqa_eval.cut_at_stop(dec, ids[: cut - 1], 0, ("</search>",)) is None


def test_heldout_subset_is_stable():
    items = list(range(100))
    assert psqa_eval.heldout_subset(items, 10, seed=1) == psqa_eval.heldout_subset(items, 10, seed=1)
    assert len(psqa_eval.heldout_subset(items, 1000)) == 100


@pytest.mark.integration
def test_cli_on_a_tiny_lfm2_moe_checkpoint(tmp_path, monkeypatch, retriever):
    _tiny_lfm2_moe(tmp_path / "ckpts" / "v3", ["conv", "full_attention", "conv"])
    argv = ["--watch", str(tmp_path / "ckpts"), "--out", str(tmp_path / "out"), "--retriever", retriever.url,
            "--data-dir", str(_test_split(tmp_path)), "--questions", "2", "--k", "2", "--max-new-tokens", "12",
            "--device", "cpu", "--poll-s", "0"]
    monkeypatch.setattr(psqa_eval.time, "sleep", lambda s: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        psqa_eval.main(argv)  # one pass over the watched directory, then stop at the poll sleep
    points = psqa_eval.read_curve(tmp_path / "out")
    assert [p.version for p in points] == [3] and points[0].questions == 2 and points[0].k == 2
    assert 0 < points[0].response_tokens <= 12 and 0.0 <= points[0].pass1 <= 1.0
    assert (tmp_path / "out" / "psqa_eval.png").stat().st_size > 1000
    with pytest.raises(KeyboardInterrupt):
        psqa_eval.main(argv)  # resumes: version 3 is not evaluated twice
    assert len(psqa_eval.read_curve(tmp_path / "out")) == 1


def _cli(*argv: str, cwd: Path):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "entrypoints.psqa_eval", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.integration
def test_cli_refuses_what_would_fail_late_or_quietly(tmp_path):
    """A dead or garbage retriever once gave held-out points of 0.0 with exit 0, --watch of a missing directory
    waited forever, and the default --device cuda:1 on a CPU box was a traceback: each is one sentence, exit 2,
    before any model loads, and no point is written."""
    import socket
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Garbage(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>not a retriever</html>")

        def log_message(self, *a):
            pass

    garbage = ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=garbage.serve_forever, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket closes
    (tmp_path / "ckpts").mkdir()
    out = tmp_path / "out"
    base = ["--out", str(out), "--data-dir", str(tmp_path), "--questions", "1"]
    try:
        cases = [(["--watch", str(tmp_path / "none"), "--retriever", dead, "--device", "cpu"], "--watch"),
                 (["--watch", str(tmp_path / "ckpts"), "--retriever", dead, "--device", "cpu"], "does not answer"),
                 (["--watch", str(tmp_path / "ckpts"), "--retriever", f"http://127.0.0.1:{garbage.server_port}",
                   "--device", "cpu"], "does not answer")]
        import torch

        if not torch.cuda.is_available():  # as REPRODUCE.md writes it, without --device
            cases.append((["--watch", str(tmp_path / "ckpts"), "--retriever", dead], "--device cuda:1"))
        # the retriever: a typo named as typed; none at all names both ways to give it
        cases += [(["--watch", str(tmp_path / "ckpts"), "--retriever", "notaurl", "--device", "cpu"],
                   "--retriever 'notaurl' is not an http(s) URL"),
                  (["--watch", str(tmp_path / "ckpts"), "--device", "cpu"], "pass --retriever URL or set DRL_RETRIEVER_URL")]
        for argv, says in cases:
            r = _cli(*argv, *base, cwd=tmp_path)
            assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert psqa_eval.read_curve(out) == []
    finally:
        garbage.shutdown()
        garbage.server_close()


@pytest.mark.integration
def test_cli_follows_a_runs_published_versions_in_the_bucket(tmp_path, monkeypatch, retriever):
    """The learner's checkpoints are not HF models on either engine, so --watch had nothing to watch on a fleet
    run: --run follows the bucket as a worker does and scores the newest version the signed pointer names."""
    from opsbucket import manifest_for

    from trainer.publish.publisher import Publisher, drop_aliases
    from worker_contract import signing
    from worker_contract.manifest import create_or_resume
    from worker_contract.store.file import FileStore
    from worker_contract.worker.identity import local_identity

    base = tmp_path / "base"
    model = _tiny_lfm2_moe(base, ["conv", "full_attention"])
    store, key = FileStore(tmp_path / "bucket"), signing.generate_private_key()
    manifest = manifest_for("eval-run", key=key).model_copy(update={**local_identity(base), "task": "psqa",
                                                                     "max_new_tokens": 6})
    create_or_resume(store, manifest, resume=False)
    pub = Publisher(store, manifest, key, anchor_interval=4, progress=False)
    state = drop_aliases(model.state_dict())  # the tied head, as the learner publishes
    pub.publish_anchor({k: v.detach().clone() for k, v in state.items()})
    pub.publish({k: v.detach() + 0.01 for k, v in state.items()})  # v2: a patch
    argv = ["--run", "eval-run", "--base", str(base), "--store", store.url, "--out", str(tmp_path / "out"),
            "--data-dir", str(_test_split(tmp_path)), "--questions", "2", "--k", "2", "--device", "cpu", "--poll-s", "0"]
    monkeypatch.setenv("DRL_RETRIEVER_URL", retriever.url)  # the worker's variable names the retriever here too
    monkeypatch.setattr(psqa_eval.time, "sleep", lambda s: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        psqa_eval.main(argv)  # one poll: the newest version, then stop at the sleep
    points = psqa_eval.read_curve(tmp_path / "out")
    assert [p.version for p in points] == [2] and "run eval-run v2" in points[0].model
    assert 0 < points[0].response_tokens <= 6  # the run's own episode budget (run.json), as its workers sample
    with pytest.raises(KeyboardInterrupt):
        psqa_eval.main(argv)  # the next poll: v2 is scored already
    pub.publish({k: v.detach() + 0.02 for k, v in state.items()})  # v3
    with pytest.raises(KeyboardInterrupt):
        psqa_eval.main([*argv, "--every", "2"])  # v3 is 1 past v2: not yet
    assert [p.version for p in psqa_eval.read_curve(tmp_path / "out")] == [2]
    with pytest.raises(KeyboardInterrupt):
        psqa_eval.main(argv)
    assert [p.version for p in psqa_eval.read_curve(tmp_path / "out")] == [2, 3]
    # an --out holding another run's curve is refused: the two would be drawn as one line
    other_out = tmp_path / "other-out"
    psqa_eval.append_point(other_out, points[0].model_copy(update={"model": "file:///elsewhere run other-run v2"}))
    with pytest.raises(ValueError, match="holds the curve of file:///elsewhere run other-run: give each run"):
        psqa_eval.main([*argv[:argv.index("--out") + 1], str(other_out), *argv[argv.index("--out") + 2:]])
    # a base that is not the run's model is refused, as a worker refuses it
    other = tmp_path / "other"
    _tiny_lfm2_moe(other, ["conv", "full_attention", "conv"])
    with pytest.raises(ValueError, match="is not the model of run 'eval-run'"):
        psqa_eval.main([*argv[:3], str(other), *argv[4:]])
    # the evaluation's model keeps no MoE routes: a sampler takes a worker's, nothing would take these (about
    # 3 GB of router ids an evaluation at the fleet's size, on the GPU, growing every poll)
    from worker_contract.tasks.psqa import PsqaTask
    from worker_contract.tasks.psqa_retrieval import RetrieverClient, search_tool

    args = psqa_eval._parser("psqa_eval").parse_args(argv)
    published = psqa_eval.PublishedRun(store, "eval-run", base, "cpu")
    assert published.newest() == 3
    task = PsqaTask(args.data_dir)
    published.evaluate(task.dataset("test")[:1], task, search_tool(RetrieverClient(retriever.url), k=1), args)
    assert published._policy.recorder is None
    # a pointer that does not verify (anyone with the bucket's keys can write one) is waited out, not fatal
    from worker_contract import layout

    store.put(layout.pointer_key("eval-run"), b"{}")
    assert published.newest() == 3
    with pytest.raises(ValueError, match="no run.json"):
        psqa_eval.main([*argv[:1], "no-such-run", *argv[2:]])
    with pytest.raises(ValueError, match="--run needs --base"):
        psqa_eval.main([a for a in argv if a not in ("--base", str(base))])
