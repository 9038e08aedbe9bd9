"""slime's rollout types, imported lazily; local twins with the same fields when slime is absent.

The twins follow `slime/utils/types.py::Sample` and `slime/rollout/base_types.py` at slime 624b824a
(docs/slime.md) field for field, so code and tests written against them behave the
same inside the slime image, where the real classes are used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


def _local_types():
    @dataclass
    class Sample:
        group_index: int | None = None
        index: int | None = None
        rollout_id: int | None = None
        prompt: str | list[dict[str, str]] = ""
        tokens: list[int] = field(default_factory=list)
        multimodal_inputs: dict[str, Any] | None = None
        multimodal_train_inputs: dict[str, Any] | None = None
        response: str = ""
        response_length: int = 0
        label: str | None = None
        reward: float | dict[str, Any] | None = None
        loss_mask: list[int] | None = None
        weight_versions: list[str] = field(default_factory=list)
        rollout_log_probs: list[float] | None = None
        rollout_routed_experts: Any = None
        remove_sample: bool = False
        teacher_log_probs: list[float] | None = None

        class Status(Enum):
            PENDING = "pending"
            COMPLETED = "completed"
            TRUNCATED = "truncated"
            ABORTED = "aborted"
            FAILED = "failed"

        status: Status = Status.PENDING
        metadata: dict = field(default_factory=dict)
        train_metadata: dict | None = None

    @dataclass
    class RolloutFnTrainOutput:
        samples: list[list[Sample]]
        metrics: dict[str, Any] = None

    @dataclass
    class RolloutFnEvalOutput:
        data: dict[str, dict[str, Any]]
        metrics: dict[str, Any] = None

    return Sample, RolloutFnTrainOutput, RolloutFnEvalOutput


def slime_types() -> tuple[type, type, type, bool]:
    """(Sample, RolloutFnTrainOutput, RolloutFnEvalOutput, from_slime)."""
    try:
        from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
        from slime.utils.types import Sample

        return Sample, RolloutFnTrainOutput, RolloutFnEvalOutput, True
    except ImportError:
        return (*_LOCAL, False)


_LOCAL = _local_types()
