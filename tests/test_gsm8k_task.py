"""GSM8K task: answer extraction on realistic completions, the reward, the prompt, the data loaders, and the
generated arithmetic task's split discipline (held-out problems never appear in training)."""

from __future__ import annotations

import json
import sys

import pytest

from worker_contract.tasks import Problem, get_task
from worker_contract.tasks.arithmetic import DEFAULT_SPLITS, is_heldout_tuple, question_numbers
from worker_contract.tasks.gsm8k import canonical_number, extract_answer, gold_answer, load_gsm8k

# (completion, what it commits to)
COMPLETIONS = [
    # the GSM8K reference form, with calculator annotations
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72", "72"),
    ("#### 1,234", "1234"),                                        # thousands separator
    ("She pays 3 * $1,250.00 = $3,750.00\n#### $3,750", "3750"),     # currency and separators
    ("So the answer is:\n####18", "18"),                           # no space after the marker
    ("#### 18.00", "18"),                                          # trailing zero decimals
    ("#### 2.5 hours", "2.5"),                                     # decimal with a unit
    ("The temperature fell to -4 degrees.\n#### -4", "-4"),        # negative
    ("#### \u22127", "-7"),                                        # Unicode minus sign
    ("#### 72\n\nExplanation: 70 + 2 = 72. #### 5", "72"),         # the first marker wins
    ("#### the answer is 15 cm", "15"),                            # words between marker and number
    # no marker: the last number
    ("Janet has 16 - 3 - 4 = 9 eggs left, so she makes 9 * $2 = $18 every day.", "18"),
    ("The total is 1,000,000 dollars.", "1000000"),
    ("He walked 12.5 km.", "12.5"),
    ("It takes 45 minutes", "45"),
    ("x = 12-5=7", "7"),                                           # a minus between digits is not a sign
    ("Half of it is .5", "0.5"),
    ("The answer is 50%.", "50"),
    ("I am not sure.", None),
    ("#### ", None),
    ("", None),
    # a marker with no number falls back to the last number in the text
    ("3 + 4 = 7\n#### seven", "7"),
    # completions of the generated task's form
    ("8 - 1 = 7\n7 * 3 = 21\n21 * 3 = 63\n#### 63", "63"),
    ("2 * 5 = 11\n11 * 2 = 26\n#### 26", "26"),
]


@pytest.mark.parametrize("completion,expected", COMPLETIONS)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize("text,canon", [("1,234.50", "1234.5"), ("-0", "0"), ("$18", "18"), ("+3", "3"),
                                        ("007", "7"), ("12 apples", None), ("abc", None)])
def test_canonical_number(text, canon):
    assert canonical_number(text) == canon


def test_reward_is_one_for_the_right_value_in_any_spelling_and_zero_otherwise():
    task = get_task("gsm8k")
    p = Problem(id="p1", question="q", answer="3750")
    assert task.reward("#### $3,750.00", p) == 1.0
    assert task.reward("so she pays 3750 dollars", p) == 1.0
    assert task.reward("#### 3751", p) == 0.0
    assert task.reward("#### 3750.5", p) == 0.0
    assert task.reward("no idea", p) == 0.0
    # the first committed answer counts, not a later correct number
    assert task.reward("#### 12\nwait, actually 3750", p) == 0.0


def test_prompt_is_one_user_message_asking_for_the_marker():
    task = get_task("gsm8k")
    msgs = task.messages(Problem(id="p", question="  How many?  ", answer="1"))
    assert msgs == [{"role": "user", "content": 'How many?\nLet\'s think step by step and output the final '
                                                'answer after "####".'}]


def test_unknown_task_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match=r"unknown task 'gsm9k'; known tasks: .*arithmetic.*gsm8k"):
        get_task("gsm9k")


def test_unknown_split_is_refused():
    with pytest.raises(ValueError, match="split='dev'"):
        get_task("arithmetic").dataset("dev")  # type: ignore[arg-type]


def test_gold_answer_of_reference_solutions():
    assert gold_answer("5 + 6 = <<5+6=11>>11\n#### 11") == "11"
    assert gold_answer("...\n#### 1,080") == "1080"
    with pytest.raises(ValueError, match="ends in '#### <answer>'"):
        gold_answer("no marker here")


def test_real_gsm8k_loads_from_a_local_copy(tmp_path, monkeypatch):
    rows = [{"question": "Tom has 3 apples and buys 2. How many?", "answer": "3 + 2 = <<3+2=5>>5\n#### 5"},
            {"question": "A shirt costs $1,200. Two cost?", "answer": "2 * 1200 = 2400\n#### 2,400"}]
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setenv("DRL_GSM8K_DIR", str(tmp_path))
    task = get_task("gsm8k")
    ds = task.dataset("test")
    assert len(ds) == 2 and ds[1].answer == "2400" and ds[1].id == "gsm8k-test-1"
    assert task.reward(ds[1].solution, ds[1]) == 1.0
    with pytest.raises(ValueError, match="has no train.jsonl"):
        task.dataset("train")


def test_real_gsm8k_without_datasets_names_the_fix(monkeypatch):
    monkeypatch.delenv("DRL_GSM8K_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as on a machine without the package
    with pytest.raises(ValueError, match="pip install datasets"):
        load_gsm8k("train")


# -- the generated arithmetic task ---------------------------------------------------------------------
def test_generated_problems_are_deterministic_and_their_solutions_score_one():
    task = get_task("arithmetic")
    train, test = task.dataset("train"), task.dataset("test")
    assert train[5] == get_task("arithmetic").dataset("train")[5]
    for p in [*train[:200], *test[:200]]:
        assert p.solution.endswith(f"#### {p.answer}")
        assert task.reward(p.solution, p) == 1.0
        assert int(p.answer) >= 0


def test_heldout_problems_never_appear_in_training():
    task = get_task("arithmetic")
    train, test = task.dataset("train"), task.dataset("test")
    held = [question_numbers(p.question) for p in test[: len(test)]]
    assert len(test) == DEFAULT_SPLITS["test"].size
    assert all(is_heldout_tuple(n) for n in held)
    seen_train = {question_numbers(p.question) for p in train[:5000]}
    assert not any(is_heldout_tuple(n) for n in seen_train)
    assert not seen_train & set(held)
    assert {p.question for p in train[:5000]}.isdisjoint({p.question for p in test[: len(test)]})
    assert DEFAULT_SPLITS["train"].seed != DEFAULT_SPLITS["test"].seed


def test_gsm8k_names_its_stand_in_where_its_data_cannot_be_loaded(tmp_path, monkeypatch):
    """The local runs read which task stands in for GSM8K from the task (`stand_in`), not from its name."""
    from worker_contract.tasks import get_task
    from worker_contract.tasks.gsm8k import GSM8KTask

    monkeypatch.delenv("DRL_GSM8K_DIR", raising=False)
    assert GSM8KTask(local_dir=str(tmp_path)).stand_in() == "arithmetic"  # a copy without train.jsonl
    (tmp_path / "train.jsonl").write_text("")
    assert GSM8KTask(local_dir=str(tmp_path)).stand_in() is None
    assert get_task("arithmetic").stand_in() is None and get_task("psqa").stand_in() is None
