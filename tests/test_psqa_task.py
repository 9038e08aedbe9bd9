"""PaperSearchQA task: cover-EM table, answer/search parsing, pass@k, episode masks, data loading."""

from __future__ import annotations

import json

import pytest

from worker_contract.schema import RolloutRecord, SamplingParams, decode_record, encode_record
from worker_contract.tasks import psqa
from worker_contract.tasks.psqa import PsqaProblem, PsqaTask, TurnOutput, cover_em, pass_at_k, run_episode


@pytest.fixture(scope="module")
def tok():
    """A real byte-level BPE tokenizer trained on the spot (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    text = ["<think> search the corpus </think> <search> dystrophin gene </search> <answer> DMD </answer>",
            "<information>Doc 1 (Title: Muscle) dystrophin is a protein</information>"] * 50
    t.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return t


COVER_EM_TABLE = [
    ("dystrophin", ["dystrophin", "DMD protein"], 1.0),
    ("The dystrophin protein", ["dystrophin"], 1.0),          # gold covered by a longer prediction
    ("CFTR", ["cystic fibrosis transmembrane conductance regulator", "CFTR"], 1.0),
    ("cftr.", ["CFTR"], 1.0),                                  # case and punctuation normalized
    ("dystrophin", ["DMD protein"], 0.0),
    ("cat", ["a"], 0.0),                                       # article-only gold never matches
    ("category", ["cat"], 0.0),                                # whole words, not raw substrings
    ("BRCA-1 mutation", ["brca 1"], 1.0),                      # hyphen becomes a word break
    ("", ["x"], 0.0),
    (None, ["x"], 0.0),
    ("interleukin 6", ["interleukin 6 receptor"], 0.0),        # prediction must cover the gold, not vice versa
]


@pytest.mark.parametrize("pred,gold,expected", COVER_EM_TABLE)
def test_cover_em_table(pred, gold, expected):
    assert cover_em(pred, gold) == expected


def test_extract_answer_ignores_retrieved_documents():
    text = ("<search> q </search>\n\n<information>Doc 1 <answer> wrong </answer></information>\n\n"
            "<think>ok</think><answer> first </answer> then <answer> DMD </answer>")
    assert psqa.extract_answer(text) == "DMD"
    assert psqa.extract_answer("<information><answer> x </answer></information>") is None
    assert psqa.extract_answer("no tags") is None


def test_parse_search_only_at_turn_end():
    assert psqa.parse_search("<think>hm</think> <search> dystrophin gene </search>") == "dystrophin gene"
    assert psqa.parse_search("<search> a </search> then more") is None
    assert psqa.parse_search("<search>   </search>") is None
    assert psqa.parse_search("<answer> x </answer>") is None


def test_pass_at_k():
    assert pass_at_k(8, 0, 1) == 0.0
    assert pass_at_k(8, 8, 8) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(8, 9, 1)


class Scripted:
    """A policy that plays fixed turns through the real tokenizer (records what context it was given)."""

    def __init__(self, tok, turns, eos_last=True):
        self.tok, self.turns, self.eos_last, self.contexts = tok, list(turns), eos_last, []

    def __call__(self, context, budget):
        self.contexts.append(list(context))
        text = self.turns.pop(0)
        ids = self.tok.encode(text).ids
        eos = self.eos_last and not self.turns
        if eos:
            ids = ids + [self.tok.token_to_id("<eos>")]
        ids = ids[:budget]
        return TurnOutput(ids, [-0.5 - 0.01 * i for i in range(len(ids))], self.tok.decode(ids), eos and len(ids) > 0)


def test_episode_masks_tool_turns(tok):
    encode = lambda s: tok.encode(s).ids  # noqa: E731
    turns = ["<think>need facts</think> <search> dystrophin gene </search>", "<answer> DMD </answer>"]
    policy = Scripted(tok, turns)
    queries = []

    def search(q):
        queries.append(q)
        return "Doc 1 (Title: Muscle) dystrophin is a protein"

    prompt = encode("Question: which gene?")
    ep = run_episode(prompt, policy, encode, search, max_new_tokens=400)
    assert queries == ["dystrophin gene"] and ep.searches == queries
    t1 = encode(turns[0])
    tool = encode(psqa.tool_turn_text("Doc 1 (Title: Muscle) dystrophin is a protein"))
    t2 = encode(turns[1]) + [tok.token_to_id("<eos>")]
    assert ep.response_ids == t1 + tool + t2
    assert ep.loss_mask == [1] * len(t1) + [0] * len(tool) + [1] * len(t2)
    assert all(lp == 0.0 for lp, m in zip(ep.behavior_logprobs, ep.loss_mask, strict=True) if m == 0)
    assert all(lp < 0 for lp, m in zip(ep.behavior_logprobs, ep.loss_mask, strict=True) if m == 1)
    # the second turn was generated from prompt + first turn + tool output, token for token
    assert policy.contexts[1] == prompt + t1 + tool
    assert ep.finish_reason == "stop"
    problem = PsqaProblem(id="psqa-test-0", question="q", answer="DMD", golden_answers=("DMD", "dystrophin"))
    assert PsqaTask().reward(ep.text, problem) == 1.0
    # the record schema accepts the episode as a sample, and the mask survives the wire
    sample = ep.to_sample(1.0)
    rec = RolloutRecord(run="r1", worker_id="w", group_id="g", policy_version=1, plane="int8g64", task="psqa",
                        prompt_id=problem.id, prompt_ids=prompt, samples=[sample],
                        sampling=SamplingParams(temperature=1.0, max_new_tokens=400), created_at=0.0)
    assert decode_record(encode_record(rec)).samples[0].loss_mask == ep.loss_mask


def test_episode_budget_and_turn_limits(tok):
    encode = lambda s: tok.encode(s).ids  # noqa: E731
    search_turn = "<search> dystrophin gene </search>"
    # out of turns while still searching -> 'tool'; the last query is recorded but not run
    calls = []
    ep = run_episode([1], Scripted(tok, [search_turn] * 3, eos_last=False), encode,
                     lambda q: calls.append(q) or "Doc", max_new_tokens=10_000, max_turns=2)
    assert ep.finish_reason == "tool" and len(ep.searches) == 3 and len(calls) == 2
    # the budget covers tool tokens too: a long tool turn is cut at the budget -> 'length'
    n1 = len(encode(search_turn))
    ep = run_episode([1], Scripted(tok, [search_turn, "<answer> x </answer>"]), encode,
                     lambda q: "dystrophin " * 200, max_new_tokens=n1 + 5)
    assert ep.finish_reason == "length" and len(ep.response_ids) == n1 + 5
    assert ep.loss_mask == [1] * n1 + [0] * 5
    # a turn that stops without an answer, EOS or search spent its budget
    ep = run_episode([1], Scripted(tok, ["<think> still thinking"], eos_last=False), encode,
                     lambda q: "", max_new_tokens=3)
    assert ep.finish_reason == "length" and len(ep.response_ids) == 3
    # a turn the generator stopped at a bare `</answer>` (no opening tag) ended there, not at the budget
    ep = run_episode([1], Scripted(tok, ["dystrophin </answer>"], eos_last=False), encode,
                     lambda q: "", max_new_tokens=400)
    assert ep.finish_reason == "stop" and psqa.extract_answer(ep.text) is None


def test_dataset_from_local_dir(tmp_path, monkeypatch):
    rows = [{"question": "Which protein is missing in DMD?", "answer": "dystrophin",
             "golden_answers": ["dystrophin", "DMD protein"], "pmid": 123, "category": "genetics"},
            {"question": "Gene of CF?", "golden_answers": json.dumps(["CFTR"])}]
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setenv("DRL_PSQA_DIR", str(tmp_path))
    data = PsqaTask().dataset("test")
    assert len(data) == 2 and data[0].id == "psqa-test-0" and data[0].pmid == "123"
    assert data[0].golden_answers == ("dystrophin", "DMD protein") and data[1].answer == "CFTR"
    task = PsqaTask()
    msgs = task.messages(data[0])
    assert "<search>" in msgs[0]["content"] and msgs[0]["content"].endswith(data[0].question)
    assert task.reward("<answer>DMD protein</answer>", data[0]) == 1.0
    assert task.reward("<answer>utrophin</answer>", data[0]) == 0.0
    with pytest.raises(ValueError, match="train.jsonl"):
        task.dataset("train")
    with pytest.raises(ValueError, match="split"):
        task.dataset("valid")  # type: ignore[arg-type]
