"""The embedded psqa run's generated corpus: invented compounds, one short abstract each, carrying facts.

Every fact names an invented word drawn from a pool of hundreds, so a question ("Which protein does
velorin inhibit?") cannot be guessed: its answer sits in exactly one abstract. `write_dataset` writes the
retriever's corpus.jsonl ({"id", "title", "text"}) and train.jsonl / test.jsonl in the PaperSearchQA row
format (question, golden_answers, pmid), held-out entities never among the train questions' entities.
Pure Python, seeded, byte-identical on every machine.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

#: bump when the same arguments write other bytes (2: entities of two syllables, none the tail of another);
#: a cache of written data sets belongs under a name that carries it
GENERATOR_VERSION = 2
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "tr")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "n", "r", "l", "s", "x")
RELATIONS = (
    ("inhibits", "protein", "Which protein does {e} inhibit?"),
    ("is found in", "organism", "In which organism is {e} found?"),
    ("treats", "disease", "Which disease does {e} treat?"),
)
_SUFFIX = {"protein": "ase", "organism": "ia", "disease": "osis"}


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


def _unique(rng: random.Random, n: int, syllables: int, suffix: str, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        w = _word(rng, syllables) + suffix
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def _entities(rng: random.Random, n: int, syllables: int, taken: set[str]) -> list[str]:
    """`n` new names ending in "in", none the tail of another ("rixgorin" in "drixgorin" would put its
    name in two abstracts)."""
    out: list[str] = []
    tails: set[str] = set()
    while len(out) < n:
        w = _word(rng, syllables) + "in"
        if w in taken or w in tails or any(w[i:] in taken for i in range(1, len(w))):
            continue
        taken.add(w)
        tails.update(w[i:] for i in range(1, len(w)))
        out.append(w)
    return out


def generate(n_entities: int = 3000, pool: int = 300, seed: int = 0,
             entity_syllables: int = 2) -> tuple[list[dict], list[dict]]:
    """(corpus, questions): one abstract per entity and one question per (entity, relation). Entities have
    `entity_syllables` syllables and "in": two keep a name at about three tokens, which the embedded base
    (embedded/psqa_base.py) copies into its query reliably enough at temperature 1; three made it six."""
    rng = random.Random(seed)
    taken: set[str] = set()
    values = {kind: _unique(rng, pool, 2, _SUFFIX[kind], taken) for _, kind, _ in RELATIONS}
    entities = _entities(rng, n_entities, entity_syllables, taken)
    corpus, questions = [], []
    for i, e in enumerate(entities):
        facts = {kind: rng.choice(values[kind]) for _, kind, _ in RELATIONS}
        text = " ".join(f"{e.capitalize()} {rel} {facts[kind]}." for rel, kind, _ in RELATIONS)
        corpus.append({"id": str(i), "title": f"On {e}", "text": text})
        for _, kind, q in RELATIONS:
            questions.append({"question": q.format(e=e), "golden_answers": [facts[kind]], "pmid": str(i),
                              "category": kind})
    return corpus, questions


def write_dataset(out_dir: str | Path, n_entities: int = 3000, heldout_entities: int = 200, pool: int = 300,
                  seed: int = 0) -> Path:
    """corpus.jsonl, train.jsonl and test.jsonl under `out_dir`; test's entities are never in train."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus, questions = generate(n_entities, pool, seed)
    held = {str(i) for i in random.Random(seed + 1).sample(range(n_entities), heldout_entities)}
    splits = {"train": [q for q in questions if q["pmid"] not in held],
              "test": [q for q in questions if q["pmid"] in held]}
    for name, rows in (("corpus", corpus), *splits.items()):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    return out
