"""What every task is made of: the Problem record, the Task interface, lazily built and cached splits,
and the helpers that find a data set's local copy or its download. The registry is the package's
__init__.py; task modules build on this file only, so none of them imports the registry back.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from ..schema import Sample

Split = Literal["train", "test"]
SPLITS: tuple[str, ...] = ("train", "test")
#: the services a task may need beside the bucket (`Task.services`): `retriever`, the search service its
#: episodes call (infra/retriever; the workers' --retriever-url / DRL_RETRIEVER_URL)
SERVICES: tuple[str, ...] = ("retriever",)


class Problem(BaseModel):
    """One prompt of a task's data set."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
    """Stable id within the task's data set (the record's `prompt_id`; reuse is counted by it)."""
    question: str
    """The problem text shown to the model."""
    answer: str
    """The gold final answer, as a canonical number string (GSM8K: the text after `####`)."""
    solution: str | None = None
    """A worked solution ending in `#### <answer>`, the supervised target (None when unknown)."""


class Task(abc.ABC):
    """A task: data splits, the chat messages of a prompt, and the scalar reward of a completion.

    Code outside the task modules never branches on a task's name: what it needs to know of a task is one
    of the hooks below (docs/extending.md lists them with the files that read each)."""

    #: registry name, written into run.json and every rollout record
    name: ClassVar[str]
    #: sampled as multi-turn tool episodes (a tool turn is a loss-mask-0 span; the worker runs its
    #: `run_episode`); False: one prompt and one sampled turn per sample
    multi_turn: ClassVar[bool] = False
    #: the services of `SERVICES` its episodes call (the join card, the launch's hint and the local runs
    #: start or ask for them)
    services: ClassVar[tuple[str, ...]] = ()
    #: what its held-out evaluation's score is called in reports and plots
    heldout_label: ClassVar[str] = "held-out accuracy"

    def stand_in(self) -> str | None:
        """The registered task that stands in for this one where its data cannot be loaded on this machine (the
        local runs switch to it and say so); None when the data loads, or when no task stands in."""
        return None

    def batch_metrics(self, samples: Sequence[Sample]) -> Mapping[str, float]:
        """Task-specific `rollout/...` metrics of one learner batch's samples (added to the pool's own);
        none by default."""
        return {}

    @abc.abstractmethod
    def dataset(self, split: Split) -> Sequence[Problem]:
        """The problems of a split, indexable and sized ('train' for rollouts, 'test' for held-out eval)."""

    @abc.abstractmethod
    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """Chat messages (role/content) to render with the model's chat template."""

    @abc.abstractmethod
    def extract_answer(self, completion: str) -> str | None:
        """The final answer a completion commits to, or None if it gives none."""

    @abc.abstractmethod
    def reward(self, completion: str, problem: Problem) -> float:
        """Scalar reward of one completion of `problem`."""


class LazySplit(Sequence[Problem]):
    """A split of `size` problems, each made from its index when asked for (read rows or a generator):
    nothing is built up front, and slices give lists."""

    def __init__(self, split: str, size: int, make: Callable[[int], Problem]):
        self.split, self.size, self._make = split, size, make

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for the {self.split} split of {len(self)} problems")
        return self._make(i % len(self))


class CachedSplitTask(Task):
    """A task whose splits are read once (a local copy or the data set's home) and kept for its life."""

    def __init__(self, local_dir: str | None = None):
        self.local_dir = local_dir
        self._cache: dict[str, Sequence[Problem]] = {}

    def dataset(self, split: Split) -> Sequence[Problem]:
        split = check_split(split)
        if split not in self._cache:
            self._cache[split] = self._load_split(split)
        return self._cache[split]

    @abc.abstractmethod
    def _load_split(self, split: Split) -> Sequence[Problem]:
        """The problems of a checked split, from `self.local_dir` when set (called once per split)."""


def local_split_path(split: Split, local_dir: str | None, env_var: str, title: str) -> Path | None:
    """`<local_dir or $env_var>/<split>.jsonl` of a real data set, or None when no directory is set
    (then the task downloads it with `hf_datasets()`)."""
    local_dir = local_dir or os.environ.get(env_var) or None
    if not local_dir:
        return None
    path = Path(local_dir) / f"{split}.jsonl"
    if not path.exists():
        raise ValueError(f"{env_var}={local_dir!r} has no {split}.jsonl; put the {title} {split} split there")
    return path


def hf_datasets(title: str, hf_dataset: str, env_var: str):
    """The `datasets` module (present on the GPU box image; not a dependency of the contract)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"the real {title} data needs the `datasets` package (pip install datasets) to download "
                         f"{hf_dataset}, or {env_var} pointing at train.jsonl/test.jsonl") from None
    return datasets


def check_split(split: str) -> Split:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not a split; known splits: {', '.join(SPLITS)}")
    return split  # type: ignore[return-value]


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The one prompt renderer: a task's chat messages through the model's chat template (the assistant's
    turn opened), as ids with no special tokens added. The workers of every backend, the learner's held-out
    evaluations and the bases built on the spot all call it, so a prompt is the same ids everywhere."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
