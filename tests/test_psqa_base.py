"""The embedded psqa base (embedded/psqa_base.py): its supervised traces are what an episode records (tool
turn masked), a build is deterministic and cached, the directory loads in transformers and mlx-lm with the
same greedy tokens, and a bad data directory is refused in one sentence. Tiny configs: seconds each."""

from __future__ import annotations

import json

import pytest
import torch

from embedded import psqa_synth
from embedded.psqa_base import (
    PsqaBaseConfig,
    base_digest,
    batch_tensors,
    ensure_psqa_base,
    load_problems,
    make_tokenizer,
    make_trace,
    search_query,
)
from infra.retriever.index import BM25Index
from worker_contract.tasks.psqa import TurnOutput, run_episodes, tool_turn_text
from worker_contract.tasks.psqa_retrieval import format_hits

TINY = PsqaBaseConfig(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, moe_intermediate_size=32,
                      vocab_size=300, tokenizer_traces=60, sft_steps=4, short_steps=2, sft_batch_size=4, eval_questions=2,
                      max_new_tokens=48)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = psqa_synth.write_dataset(tmp_path_factory.mktemp("psqa"), n_entities=80, heldout_entities=8, pool=20)
    index = BM25Index.build(json.loads(line) for line in open(d / "corpus.jsonl"))
    return d, lambda q: format_hits(index.search(q, 3))  # what the retriever service answers, in process


@pytest.fixture(scope="module")
def built(data, tmp_path_factory):
    d, search = data
    return ensure_psqa_base(d, tmp_path_factory.mktemp("cache"), search, cfg=TINY, log=lambda s: None)


def test_a_trace_is_what_an_episode_records_with_the_tool_turn_masked(data):
    d, search = data
    task, train, _ = load_problems(d)
    problem = train[0]
    docs = search(search_query(problem))
    assert problem.answer in docs and "No results" not in docs  # the query finds the question's abstract
    tok = make_tokenizer([docs, problem.question], 300)
    trace = make_trace(tok, task, problem, documents=docs, guess="wrongase")
    tool = tok.encode(tool_turn_text(docs), add_special_tokens=False)
    start = trace.loss_mask.index(0)
    assert trace.response_ids[start:start + len(tool)] == tool  # the documents, tokenized on their own
    assert trace.loss_mask == [1] * start + [0] * len(tool) + [1] * (len(trace.loss_mask) - start - len(tool))
    turns = [trace.response_ids[:start], trace.response_ids[start + len(tool):]]
    # the same tokens replayed through the task's episode code give the same ids and mask
    replay = iter(turns)

    def generate_batch(contexts, budgets):
        ids = next(replay)
        return [TurnOutput(ids, [-1.0] * len(ids), tok.decode(ids, skip_special_tokens=True), ids[-1] == tok.eos_token_id)]

    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    (ep,) = run_episodes([trace.prompt_ids], generate_batch, encode, search, max_new_tokens=400)
    assert ep.searches == [search_query(problem)]
    assert (ep.response_ids, ep.loss_mask) == (trace.response_ids, trace.loss_mask)
    assert task.reward(ep.text, problem) == 1.0
    # supervised labels: only the mask-1 tokens, never the prompt or the documents
    _, labels, _ = batch_tensors([trace], tok.pad_token_id)
    target = [-100] * len(trace.prompt_ids) + [i if m else -100 for i, m in zip(trace.response_ids, trace.loss_mask, strict=True)]
    assert labels[0].tolist() == target
    direct = make_trace(tok, task, problem, documents=None, guess="wrongase")
    assert set(direct.loss_mask) == {1} and "<search>" not in tok.decode(direct.response_ids)


def test_the_build_is_deterministic_and_cached(data, built, tmp_path):
    d, search = data
    path, report = built
    again, report2 = ensure_psqa_base(d, tmp_path, search, cfg=TINY, log=lambda s: None)
    assert again.name == path.name and report2.weights_sha256 == report.weights_sha256
    assert (again / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    lines = []
    hit, _ = ensure_psqa_base(d, tmp_path, search, cfg=TINY, log=lines.append)
    assert hit == again and lines == []  # the cache: nothing built
    other, _ = ensure_psqa_base(d, tmp_path, lambda q: search(q) + " ", cfg=TINY, log=lambda s: None)
    assert other.name != path.name  # what the search tool answers shapes the traces, so the digest
    train = load_problems(d)[1]
    assert base_digest(TINY, d, search, train) == path.name.removeprefix("psqa-base-")
    assert base_digest(TINY, d, search, train, "cuda") != base_digest(TINY, d, search, train)  # other float sums


def test_the_directory_loads_in_transformers_and_mlx_lm_with_the_same_greedy_tokens(data, built):
    mx = pytest.importorskip("mlx.core", reason="mlx (mlx[cpu] on Linux)")
    mlx_lm = pytest.importorskip("mlx_lm")
    from transformers import AutoModelForCausalLM

    from worker_contract.worker.chat import ChatTokenizer

    path, _ = built
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "lfm2_moe" and cfg["num_experts"] == TINY.num_experts
    task, _, test = load_problems(data[0])
    chat = ChatTokenizer(path)
    prompt = chat.prompt_ids(task.messages(test[0]))
    assert chat.eos_ids == [chat.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert chat.decode(chat.encode("<search> x </search>")) == "<search> x </search>"  # tags survive a decode
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    mlx_model, _ = mlx_lm.load(str(path))
    ids = list(prompt)
    for _ in range(6):
        with torch.no_grad():
            t_logits = hf(input_ids=torch.tensor([ids])).logits[0, -1].float().numpy()
        m_logits = mlx_model(mx.array([ids]))[0, -1].astype(mx.float32)
        assert abs(t_logits - m_logits.tolist()).max() < 1e-3
        assert int(t_logits.argmax()) == int(mx.argmax(m_logits).item())
        ids.append(int(t_logits.argmax()))


def test_a_bad_data_directory_is_refused_in_one_sentence(tmp_path, data):
    with pytest.raises(ValueError, match=r"has no train\.jsonl; write it with embedded\.psqa_synth") as e:
        ensure_psqa_base(tmp_path / "nowhere", tmp_path / "cache", data[1], cfg=TINY)
    assert "\n" not in str(e.value)
    (tmp_path / "empty").mkdir()
    for split in ("train", "test"):
        (tmp_path / "empty" / f"{split}.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty train split"):
        ensure_psqa_base(tmp_path / "empty", tmp_path / "cache", data[1], cfg=TINY)
    assert not (tmp_path / "cache").exists()
