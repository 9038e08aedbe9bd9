"""The embedded psqa corpus: answers in exactly one abstract, a held-out split, seeded and stable."""
import hashlib
import json

from embedded import psqa_synth
from worker_contract.tasks.psqa import cover_em, problem_from_row


def test_every_answer_sits_in_its_one_abstract_and_the_split_is_disjoint(tmp_path):
    out = psqa_synth.write_dataset(tmp_path, n_entities=400, heldout_entities=40, pool=60)
    corpus = [json.loads(line) for line in open(out / "corpus.jsonl")]
    train = [json.loads(line) for line in open(out / "train.jsonl")]
    test = [json.loads(line) for line in open(out / "test.jsonl")]
    assert len(corpus) == 400 and len(test) == 40 * len(psqa_synth.RELATIONS)
    assert {q["pmid"] for q in train}.isdisjoint(q["pmid"] for q in test)
    by_id = {d["id"]: d for d in corpus}
    for q in train + test:
        problem_from_row("test", 0, q)
        entity = by_id[q["pmid"]]["title"].removeprefix("On ")
        assert entity in q["question"]
        assert [d["id"] for d in corpus if entity in d["text"].lower()] == [q["pmid"]]
        assert cover_em(by_id[q["pmid"]]["text"], q["golden_answers"]) == 1.0
    # the most common answer of a relation covers few questions: no guess scores
    for _, kind, _ in psqa_synth.RELATIONS:
        answers = [q["golden_answers"][0] for q in train if q["category"] == kind]
        assert max(answers.count(a) for a in set(answers)) / len(answers) < 0.06


def test_the_dataset_is_byte_identical_for_a_seed(tmp_path):
    digests = []
    for sub in ("a", "b"):
        out = psqa_synth.write_dataset(tmp_path / sub, n_entities=300, heldout_entities=30, pool=50)
        digests.append(hashlib.sha256(b"".join((out / f).read_bytes() for f in
                                                ("corpus.jsonl", "train.jsonl", "test.jsonl"))).hexdigest())
    assert digests[0] == digests[1]
