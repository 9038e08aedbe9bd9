"""The rollout record: one immutable object per prompt group, written create-only by a worker.

Wire form: the JSON of `RolloutRecord`, zstd-compressed (`encode_record` / `decode_record`). Every field's
meaning is written beside it; `docs/contract.md` has an example. Structural validation lives here; checks
that need the run's state (vocabulary, current version, staleness, reuse) live in the learner's rollout
source, which drops a bad record with a counted reason and never stops.
"""

from __future__ import annotations

import json
import math
from typing import Literal

import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .planes import PlaneName

SCHEMA_VERSION = 1
#: the format of a record that carries MoE routes (`routes`); a record without them stays version 1
ROUTED_SCHEMA_VERSION = 2
#: record formats this contract reads
SCHEMA_VERSIONS = (SCHEMA_VERSION, ROUTED_SCHEMA_VERSION)
#: a compressed record larger than this is refused before it is decompressed
MAX_RECORD_BYTES = 32 << 20
#: and one that decompresses past this (a zstd bomb) is refused too
MAX_DECOMPRESSED_BYTES = 128 << 20

FinishReason = Literal["stop", "length", "abort", "tool"]


class RecordError(ValueError):
    """A record that cannot be decoded or does not follow the schema."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(gt=0, description="Softmax temperature the worker sampled at (the run's).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus cutoff; the contract's default is 1.0 (off).")
    max_new_tokens: int = Field(gt=0, description="Response length budget per sample.")


class Sample(BaseModel):
    """One completion of the group's prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    response_ids: list[int] = Field(description="Token ids after the prompt (multi-turn: tool output included).")
    behavior_logprobs: list[float] = Field(
        description="Log-prob of each response token under the policy that sampled it, at the run's "
        "temperature, from the same forward it was sampled from. 0.0 where loss_mask is 0."
    )
    loss_mask: list[int] = Field(description="1 = train on this token; 0 = not (tool output in multi-turn).")
    reward: float = Field(description="Scalar reward from the task's scorer.")
    finish_reason: FinishReason = Field(description="stop (EOS), length (budget hit), abort, tool.")

    @model_validator(mode="after")
    def _lengths_agree(self) -> Sample:
        n = len(self.response_ids)
        if len(self.behavior_logprobs) != n or len(self.loss_mask) != n:
            # a typed error so decode_record can report it with its own reason ("length_mismatch")
            raise PydanticCustomError(
                "length_mismatch",
                "length mismatch: {n} response ids, {lp} log-probs, {lm} mask entries",
                {"n": n, "lp": len(self.behavior_logprobs), "lm": len(self.loss_mask)},
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask entries must be 0 or 1")
        return self


class RouteBlob(BaseModel):
    """The MoE routes of a group (worker_contract/routes.py writes and reads them; docs/contract.md).

    `data` is base64 of one zstd frame of uint8 expert ids laid out [tokens, layers, top_k]: first the
    prompt's tokens, then each sample's response tokens up to, not including, its last trained (sampled)
    token, sample after sample. Those are the tokens whose outputs predict a sampled token."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: int = Field(ge=1, le=1024, description="MoE layers recorded, in the model's layer order.")
    top_k: int = Field(ge=1, le=256, description="Experts per token and layer (the model's num_experts_per_tok).")
    data: str = Field(description="base64 of zstd of the uint8 ids [tokens, layers, top_k], each token's ids sorted.")


class RolloutRecord(BaseModel):
    """A prompt group: `n_samples` completions of one prompt, all sampled by one policy version."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1, 2] = Field(SCHEMA_VERSION, description="Version of this record format: 1, or 2 "
                                          "for a record that carries `routes` (an MoE model's).")
    run: str = Field(description="The run id (DRL_RUN) the worker joined.")
    worker_id: str = Field(description="Stable id of the worker that produced the group.")
    group_id: str = Field(description="Unique id of this group (the key's last segment).")
    policy_version: int = Field(ge=1, description="Version of the weights that sampled every sample.")
    plane: PlaneName = Field(description="Weight plane the worker ran (DRL_PULSE_PLANE).")
    task: str = Field(description="Task name (gsm8k, psqa, arithmetic, ...).")
    prompt_id: str = Field(description="Stable id of the prompt in the task's data set; reuse is counted by it.")
    prompt_ids: list[int] = Field(description="Prompt token ids (chat template applied).")
    sampling: SamplingParams
    samples: list[Sample] = Field(description="Exactly DRL_N_SAMPLES completions.")
    created_at: float = Field(description="Unix time the worker finished the group.")
    routes: RouteBlob | None = Field(None, description="MoE models: the experts each token was routed to while "
                                     "sampling (schema_version 2); None for a dense model (version 1).")

    @model_validator(mode="after")
    def _version_names_routes(self) -> RolloutRecord:
        if (self.routes is not None) != (self.schema_version == ROUTED_SCHEMA_VERSION):
            raise ValueError(f"schema_version {self.schema_version} with routes "
                             f"{'present' if self.routes is not None else 'absent'}: version "
                             f"{ROUTED_SCHEMA_VERSION} carries routes, version {SCHEMA_VERSION} does not")
        return self

    @field_validator("samples")
    @classmethod
    def _not_empty(cls, v: list[Sample]) -> list[Sample]:
        if not v:
            raise ValueError("a group needs at least one sample")
        return v


def encode_record(record: RolloutRecord) -> bytes:
    """Serialize a record for upload (compact JSON, zstd level 3)."""
    for s in record.samples:
        if not math.isfinite(s.reward) or not all(math.isfinite(x) for x in s.behavior_logprobs):
            raise ValueError("refusing to encode a record with non-finite reward or log-probs")
    raw = record.model_dump_json().encode()
    return zstandard.ZstdCompressor(level=3).compress(raw)


def decode_record(blob: bytes) -> RolloutRecord:
    """Parse an uploaded record; raises `RecordError` with a short reason for anything malformed."""
    if len(blob) > MAX_RECORD_BYTES:
        raise RecordError("oversized", f"{len(blob)} bytes > {MAX_RECORD_BYTES}")
    raw = _decompress_bounded(blob)
    try:
        # NaN/Infinity parse, then fail below; a key given twice is ambiguous (parsers differ on which wins)
        data = json.loads(raw, parse_constant=lambda c: float(c), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError("malformed", f"not JSON ({e})") from None
    except RecursionError:
        raise RecordError("malformed", "JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise RecordError("malformed", "top level is not an object")
    if data.get("schema_version") not in SCHEMA_VERSIONS or isinstance(data.get("schema_version"), bool):
        raise RecordError("schema_version", f"schema_version={data.get('schema_version')!r}, expected one of "
                          f"{SCHEMA_VERSIONS}")
    try:
        return RolloutRecord.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        if any(err["type"] == "length_mismatch" for err in errors):
            first = next(err for err in errors if err["type"] == "length_mismatch")
            raise RecordError("length_mismatch", f"{_loc(first)}: {first['msg']}") from None
        raise RecordError("malformed", f"{_loc(errors[0])}: {errors[0]['msg']}"
                          + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else "")) from None


def _decompress_bounded(blob: bytes, limit: int = MAX_DECOMPRESSED_BYTES) -> bytes:
    """The first zstd frame, decompressed to at most `limit` bytes (as before, bytes after it are
    ignored). `ZstdDecompressor.decompress` trusts the frame header's content size and allocates all of it
    (a 32 KB record can claim a terabyte), so feed the input in small steps: a step of _STEP bytes can
    expand to at most ~_STEP/4 blocks of 128 KiB, which bounds memory whatever the header says."""
    try:
        declared = zstandard.frame_content_size(blob)
        if declared > limit:
            raise RecordError("oversized", f"{declared} bytes once decompressed > {limit}")
        d = zstandard.ZstdDecompressor().decompressobj()
        out, total = [], 0
        for i in range(0, len(blob), _STEP):
            chunk = d.decompress(blob[i : i + _STEP])
            total += len(chunk)
            if total > limit:
                raise RecordError("oversized", f"more than {limit} bytes once decompressed")
            out.append(chunk)
            if d.eof:
                break
    except zstandard.ZstdError as e:
        raise RecordError("malformed", f"not zstd ({e})") from None
    if not d.eof:
        raise RecordError("malformed", "truncated zstd frame")
    return b"".join(out)


_STEP = 512


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears twice in one object")
    return out


def _loc(err: dict) -> str:
    return ".".join(str(p) for p in err.get("loc", ())) or "record"
