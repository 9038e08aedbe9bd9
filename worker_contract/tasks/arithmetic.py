"""Generated GSM8K-format arithmetic word problems, for runs with no real data or no pretrained model.

Each problem is a short story: a starting amount, then one to `max_steps` changes (buy, give, spend,
double...), then a question. Its worked solution is one line per operation, `a + b = c`, and ends in
`#### <answer>`, exactly the GSM8K format, so the GSM8K prompt, extraction and reward apply unchanged.
More in docs/extending.md (module notes).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from .base import LazySplit, Problem, Split, check_split
from .gsm8k import GSM8KTask

HELDOUT_MODULUS = 8
_MAX_TRIES = 10_000

NAMES = ["Tom", "Ann", "Ben", "Mia", "Sam", "Lily", "Max", "Zoe", "Leo", "Emma", "Jack", "Nina"]
PRONOUN = {n: ("She" if n in ("Ann", "Mia", "Lily", "Zoe", "Emma", "Nina") else "He") for n in NAMES}
ITEMS = ["apples", "pens", "books", "cards", "stickers", "marbles", "cookies", "shells", "stamps", "toys"]
SHOPS = ["a book", "a toy", "a hat", "lunch", "a game", "a lamp"]


class SplitSpec(BaseModel):
    """How one split's problems are drawn."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    seed: str
    """Seed of the split (problem i is drawn from Random(f'{seed}:{i}'))."""
    size: int = Field(ge=1)
    """Number of problems in the split."""
    min_operand: int = Field(ge=1)
    """Smallest starting amount or added/removed amount."""
    max_operand: int = Field(ge=1)
    """Largest starting amount or added/removed amount."""
    max_factor: int = Field(ge=2)
    """Largest multiplier (boxes of N, doubles, triples)."""
    ops: str = Field("+-*", pattern=r"^[+*-]+$")
    """Operations a story may use: + (buy, earn, get), - (give, lose, spend), * (boxes of, doubles, triples)."""
    min_steps: int = Field(ge=1)
    """Fewest operations in a problem."""
    max_steps: int = Field(ge=1)
    """Most operations in a problem."""


#: The default splits. Training is effectively unbounded (every index is a fresh problem); the held-out
#: split is fixed. Same difficulty, different seed, disjoint number tuples. The difficulty is tuned for
#: the embedded default's 0.85 M-parameter model: two or three additions and subtractions of one-digit
#: amounts, which it learns to work out step by step in a few minutes of supervision, but rarely gets
#: right in one leap (docs/embedded.md has the measurements).
DEFAULT_SPLITS: dict[str, SplitSpec] = {
    "train": SplitSpec(seed="arith-train-v1", size=10**9, min_operand=2, max_operand=9, max_factor=4, ops="+-",
                       min_steps=2, max_steps=3),
    "test": SplitSpec(seed="arith-heldout-v1", size=1000, min_operand=2, max_operand=9, max_factor=4, ops="+-",
                      min_steps=2, max_steps=3),
}


def question_numbers(question: str) -> tuple[int, ...]:
    """The numbers written in a question, in order: what the held-out partition is keyed on."""
    return tuple(int(n) for n in re.findall(r"\d+", question))


def is_heldout_tuple(numbers: tuple[int, ...]) -> bool:
    """Whether a number tuple is reserved for the held-out split (a stable hash, not Python's hash())."""
    digest = hashlib.sha256(",".join(map(str, numbers)).encode()).digest()
    return digest[0] % HELDOUT_MODULUS == 0


def _story(rng: random.Random, spec: SplitSpec) -> tuple[str, list[str], int]:
    """One problem: (question, solution lines, answer)."""
    name = rng.choice(NAMES)
    pro = PRONOUN[name]
    other = rng.choice([n for n in NAMES if n != name])
    money = rng.random() < 0.3
    item = rng.choice(ITEMS)
    lo, hi = spec.min_operand, spec.max_operand
    lines: list[str] = []
    if not money and "*" in spec.ops and rng.random() < 0.3:
        boxes, per = rng.randint(2, spec.max_factor), rng.randint(lo, hi)
        x = boxes * per
        sents = [f"{name} buys {boxes} boxes of {item}. Each box has {per} {item}."]
        lines.append(f"{boxes} * {per} = {x}")
    else:
        x = rng.randint(lo, hi)
        sents = [f"{name} has ${x}." if money else f"{name} has {x} {item}."]
    for _ in range(rng.randint(spec.min_steps, spec.max_steps) - (1 if lines else 0)):
        ops = spec.ops if x <= hi else spec.ops.replace("*", "")  # keep products small
        if x < 2:
            ops = ops.replace("-", "")  # never below zero
        op = rng.choice(ops or "+")
        if op == "*":
            k = rng.randint(2, min(3, spec.max_factor))
            word = {2: "doubles", 3: "triples"}[k]
            sents.append(f"Then {pro.lower()} {word} {'the money' if money else 'the ' + item}.")
            lines.append(f"{x} * {k} = {x * k}")
            x *= k
            continue
        b = rng.randint(lo, hi) if op == "+" else rng.randint(1, max(1, min(hi, x - 1)))
        if money:
            sent = f"{pro} earns ${b}." if op == "+" else f"{pro} spends ${b} on {rng.choice(SHOPS)}."
        elif op == "+":
            sent = rng.choice([f"{pro} buys {b} more {item}.", f"{other} gives {name} {b} {item}."])
        else:
            sent = rng.choice([f"{pro} gives {b} {item} to {other}.", f"{pro} loses {b} {item}."])
        sents.append(sent)
        y = x + b if op == "+" else x - b
        lines.append(f"{x} {op} {b} = {y}")
        x = y
    ask = f"How much money does {name} have now?" if money else f"How many {item} does {name} have now?"
    return " ".join(sents + [ask]), lines, x


def make_problem(spec: SplitSpec, split: str, index: int) -> Problem:
    """Problem `index` of a split: deterministic, and on the right side of the held-out partition."""
    want_heldout = split == "test"
    for attempt in range(_MAX_TRIES):
        rng = random.Random(f"{spec.seed}:{index}:{attempt}")
        question, lines, answer = _story(rng, spec)
        if is_heldout_tuple(question_numbers(question)) == want_heldout:
            solution = "\n".join(lines + [f"#### {answer}"])
            return Problem(id=f"arith-{split}-{index}", question=question, answer=str(answer), solution=solution)
    raise AssertionError(f"no {split} problem found for index {index} in {_MAX_TRIES} tries")


class ArithmeticTask(GSM8KTask):
    """Generated problems in GSM8K format; prompt, extraction and reward are GSM8K's."""

    name = "arithmetic"

    def __init__(self, splits: dict[str, SplitSpec] | None = None):
        super().__init__()
        self.splits = dict(DEFAULT_SPLITS if splits is None else splits)

    def stand_in(self) -> str | None:
        return None  # generated here: always available

    def dataset(self, split: Split) -> Sequence[Problem]:
        split = check_split(split)
        spec = self.splits[split]
        return LazySplit(split, spec.size, lambda i: make_problem(spec, split, i))
