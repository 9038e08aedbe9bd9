"""Numbers a user types are checked in one place per kind: every `python -m` CLI's numeric flag goes through
`worker_contract.cli.number` (a bound, one sentence, exit 2), and the recipe's counts and durations carry
pydantic bounds. A flag that took any int once ran without end (--groups 0), crashed (--threads -3 traceback,
99999 a segfault) or meant nothing (--wait -5, --limit 0, --budget-s -1)."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from embedded.config import EmbeddedRecipe, resolve_embedded
from worker_contract.cli import number

REPO = Path(__file__).resolve().parent.parent
#: stdlib-only files (they run as their source alone on a box): their own check, said beside the flag
OWN_CHECK = {"infra/box_check.py"}


def test_number_bounds_and_words():
    assert number(int, at_least=1)("3") == 3 and number(float, above=0)("0.5") == 0.5
    for parse, text, says in ((number(int, at_least=1), "0", "at least 1"), (number(int), "1.5", "whole number"),
                              (number(float, above=0), "-5", "above 0"), (number(float, above=0), "nan", "number"),
                              (number(int, at_least=1, at_most=64), "99999", "at most 64")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            parse(text)


def test_no_cli_flag_takes_a_bare_int_or_float():
    """Every add_argument(..., type=int|float) in our packages is a number(...) with its bounds instead."""
    bare = []
    for pkg in ("bench", "entrypoints", "infra", "trainer", "worker_contract", "embedded"):
        for path in sorted((REPO / pkg).rglob("*.py")) if (REPO / pkg).is_dir() else []:
            rel = str(path.relative_to(REPO))
            if rel in OWN_CHECK:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                    for kw in node.keywords:
                        if kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id in ("int", "float"):
                            bare.append(f"{rel}:{node.lineno}")
    assert bare == [], f"flags taking any {', '.join(bare)}: give them number(...) with bounds"


@pytest.mark.parametrize("key,value", [("embedded.workers", 0), ("embedded.workers", 1000),
                                       ("embedded.time_budget_s", -1), ("embedded.eval_problems", 0),
                                       ("embedded.max_steps", 0), ("embedded.eval_every", 0),
                                       ("embedded.base.hidden_size", 0), ("embedded.base.sft_lr", -1.0)])
def test_recipe_numbers_that_mean_nothing_are_refused(key, value):
    section, *rest = key.split(".")
    cfg = resolve_embedded("gsm8k", env={"DRL_RUN": "x"}).model_dump()
    node = cfg
    for part in [section, *rest[:-1]]:
        node = node[part]
    node[rest[-1]] = value
    with pytest.raises(ValueError, match=rest[-1]):
        EmbeddedRecipe.model_validate(cfg)
