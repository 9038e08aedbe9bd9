"""Hostile rollout records through the real rollout source, from a real (file) store.

Every record is built to be wrong in one known way (fuzzed structure, wrong types, deep nesting, duplicate
JSON keys, zstd bombs, huge sizes, NaN and infinite values, out-of-vocabulary ids, future versions,
duplicate groups, bad keys, ...), so the test knows the reason each must be dropped for. A few valid
control records are mixed in: they must be accepted, and a learner step on them must run. The source must
not raise, must count exactly the expected drops per reason and per worker, and its memory must stay
bounded (peak RSS measured around the poll, after resetting the kernel's high-water mark).
"""

from __future__ import annotations

import base64
import copy
import functools
import gc
import io
import json
import math
import os
import random
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import zstandard
from soakstats import record, soak_trials

from trainer.rollouts.pool import DROP_REASONS, MAX_TRACKED_WORKERS, BatchRules, RecordRules
from trainer.rollouts.source import RolloutSource
from worker_contract import layout
from worker_contract.routes import RouteShape, encode_routes, routed_response_tokens
from worker_contract.schema import MAX_DECOMPRESSED_BYTES, MAX_RECORD_BYTES, decode_record
from worker_contract.store.file import FileStore

RUN = "fuzz-run"
N = 4  # group size (learner_fixtures.N_SAMPLES)
VOCAB = 64  # learner_fixtures.VOCAB
MAX_NEW = 6  # learner_fixtures.MAX_NEW
CURRENT = 10
STALENESS = 3
WINDOW = range(CURRENT - STALENESS, CURRENT + 1)
_ZC = zstandard.ZstdCompressor(level=1)

#: (field, valid value maker) for type confusion: values of a type pydantic never coerces to the field's
_TOP_TYPES = {"run": "str", "worker_id": "str", "group_id": "str", "task": "str", "prompt_id": "str",
              "policy_version": "int", "prompt_ids": "list", "samples": "list", "sampling": "obj",
              "created_at": "float", "plane": "str"}
_SAMPLE_TYPES = {"response_ids": "list", "behavior_logprobs": "list", "loss_mask": "list", "reward": "float",
                 "finish_reason": "str"}
_WRONG = {"str": [5, [], {}, None, 1.5], "int": ["abc", [], {}, None, 1.5], "list": ["abc", 5, {}, None],
          "obj": ["abc", 5, [], None], "float": ["abc", [], {}, None]}


def valid(rng: random.Random, version: int, worker: str, group: str) -> dict:
    samples = []
    for i in range(N):
        k = rng.randint(1, MAX_NEW)
        samples.append({"response_ids": [rng.randrange(VOCAB) for _ in range(k)],
                        "behavior_logprobs": [-rng.uniform(0.01, 6.0) for _ in range(k)],
                        "loss_mask": [1] * k, "reward": float(i % 2), "finish_reason": "stop"})
    return {"schema_version": 1, "run": RUN, "worker_id": worker, "group_id": group, "policy_version": version,
            "plane": "bf16", "task": "arithmetic", "prompt_id": f"p-{group}",
            "prompt_ids": [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 5))],
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": MAX_NEW}, "samples": samples,
            "created_at": time.time()}


def z(obj) -> bytes:
    """zstd of a record dict as is (NaN / Infinity written as JSON's non-standard literals)."""
    text = obj if isinstance(obj, bytes | str) else json.dumps(obj, allow_nan=True)
    return _ZC.compress(text.encode() if isinstance(text, str) else text)


def _bomb(size: int, declared: bool) -> bytes:
    """A small frame of zeros that decompresses to `size` bytes, with or without the size in its header."""
    buf = io.BytesIO()
    w = zstandard.ZstdCompressor(level=1, write_content_size=declared).stream_writer(
        buf, size=size if declared else -1, closefd=False)
    chunk = b" " * (8 << 20)
    for _ in range(size // len(chunk)):
        w.write(chunk)
    w.close()
    return buf.getvalue()


class Gen:
    """Makes records: each `make_<kind>` returns (version in key, worker, group, blob, expected reason)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.n = 0
        self._bombs: dict[bool, bytes] = {}

    def ids(self) -> tuple[str, str]:
        self.n += 1
        # ~6000 distinct workers: more than the source tracks one by one (MAX_TRACKED_WORKERS)
        return f"w{self.rng.randrange(6000)}", f"g{self.n:06d}"

    def rec(self, version: int | None = None) -> tuple[int, str, str, dict]:
        v = version if version is not None else self.rng.choice(WINDOW)
        w, g = self.ids()
        return v, w, g, valid(self.rng, v, w, g)

    def sample(self, d: dict) -> dict:
        return self.rng.choice(d["samples"])

    # -- bytes and framing -----------------------------------------------------------------------------
    def make_not_zstd(self):
        v, w, g, _ = self.rec()
        return v, w, g, self.rng.randbytes(self.rng.randrange(0, 2000)), "malformed"

    def make_truncated(self):
        v, w, g, d = self.rec()
        blob = z(d)
        return v, w, g, blob[: self.rng.randrange(1, len(blob))], "malformed"

    def make_not_json(self):
        v, w, g, d = self.rec()
        text = json.dumps(d)
        cut = self.rng.randrange(1, len(text) - 1)
        junk = self.rng.choice(["", "{", "]", "\x00", "'", "\\u12"])
        return v, w, g, z(text[:cut] + junk), "malformed"

    def make_not_utf8(self):
        v, w, g, _ = self.rec()
        return v, w, g, z(b'{"run": "\xff\xfe\xc3"}'), "malformed"

    def make_not_object(self):
        v, w, g, _ = self.rec()
        return v, w, g, z(self.rng.choice(["[]", "[1,2]", "5", '"record"', "null", "true", "1e999"])), "malformed"

    def make_bomb(self):
        v, w, g, _ = self.rec()
        declared = self.rng.random() < 0.5
        if declared not in self._bombs:  # built once per kind: ~0.2 s each
            self._bombs[declared] = _bomb(MAX_DECOMPRESSED_BYTES + (8 << 20), declared)
        return v, w, g, self._bombs[declared], "oversized"

    def make_forged_size(self):
        """A 20-byte frame whose header claims up to a terabyte (zstd's one-shot API would allocate it)."""
        v, w, g, _ = self.rec()
        claim = self.rng.choice([MAX_DECOMPRESSED_BYTES + 1, 1 << 33, 1 << 40, (1 << 63) - 1])
        blob = bytes.fromhex("28b52ffd") + bytes([0xC0, 0x58]) + claim.to_bytes(8, "little") + bytes([0x19, 0, 0])
        return v, w, g, blob + b"abc", "oversized"

    def make_oversized(self):
        v, w, g, _ = self.rec()
        return v, w, g, os.urandom(MAX_RECORD_BYTES + 1), "oversized"

    def make_huge_within_limits(self):
        """Millions of token ids (well inside the size limits) with one out-of-vocabulary id at the end."""
        v, w, g, d = self.rec()
        d["prompt_ids"] = [1] * self.rng.randint(1_000_000, 2_000_000) + [VOCAB]
        return v, w, g, z(d), "vocab"

    def make_routes_on_dense(self):
        """A well-formed routed record (version 2) on this dense run: its routes are refused."""
        v, w, g, d = self.rec()
        d.update(_routes_for(d, self.rng, MOE))
        return v, w, g, z(d), "routes_unexpected"

    # -- structure -------------------------------------------------------------------------------------
    def make_schema_version(self):
        v, w, g, d = self.rec()
        if self.rng.random() < 0.3:
            del d["schema_version"]
        else:
            d["schema_version"] = self.rng.choice([0, 3, "1", None, [], 10**20, True])
        return v, w, g, z(d), "schema_version"

    def make_missing_field(self):
        v, w, g, d = self.rec()
        where = d if self.rng.random() < 0.6 else self.rng.choice([d["sampling"], self.sample(d)])
        keys = [k for k in where if k not in ("schema_version", "top_p")]  # top_p has a default
        del where[self.rng.choice(keys)]
        return v, w, g, z(d), "malformed"

    def make_extra_field(self):
        v, w, g, d = self.rec()
        where = self.rng.choice([d, d["sampling"], self.sample(d)])
        where[f"x{self.rng.randrange(10**6)}"] = self.rng.choice([1, "a", [], {}, None])
        return v, w, g, z(d), "malformed"

    def make_wrong_type(self):
        v, w, g, d = self.rec()
        if self.rng.random() < 0.6:
            field = self.rng.choice(sorted(_TOP_TYPES))
            d[field] = copy.deepcopy(self.rng.choice(_WRONG[_TOP_TYPES[field]]))
        else:
            s = self.sample(d)
            field = self.rng.choice(sorted(_SAMPLE_TYPES))
            s[field] = copy.deepcopy(self.rng.choice(_WRONG[_SAMPLE_TYPES[field]]))
        return v, w, g, z(d), "malformed"

    def make_wrong_element_type(self):
        v, w, g, d = self.rec()
        s = self.sample(d)
        field = self.rng.choice(["response_ids", "behavior_logprobs", "loss_mask"])
        s[field][self.rng.randrange(len(s[field]))] = self.rng.choice(["x", [], {}, None])
        return v, w, g, z(d), "malformed"

    def make_deep_nesting(self):
        v, w, g, d = self.rec()
        depth = self.rng.choice([40, 400, 5000, 200_000])
        text = json.dumps(d)
        field = self.rng.choice(['"task": ', '"prompt_ids": ', '"reward": ', '"sampling": '])
        nested = "[" * depth + "]" * depth if self.rng.random() < 0.5 else '{"a":' * depth + "1" + "}" * depth
        i = text.index(field) + len(field)
        j = i + len(json.dumps(_value_at(d, field)))
        return v, w, g, z(text[:i] + nested + text[j:]), "malformed"

    def make_duplicate_json_key(self):
        v, w, g, d = self.rec()
        text = json.dumps(d)
        key = self.rng.choice(['"run"', '"policy_version"', '"reward"', '"prompt_ids"'])
        i = text.index(key)
        dup = key + ": " + json.dumps(_value_at(d, key + ": ")) + ", "
        return v, w, g, z(text[:i] + dup + text[i:]), "malformed"

    def make_bad_enum(self):
        v, w, g, d = self.rec()
        choice = self.rng.randrange(4)
        if choice == 0:
            d["plane"] = self.rng.choice(["fp8", "BF16", ""])
        elif choice == 1:
            self.sample(d)["finish_reason"] = self.rng.choice(["boom", "", "STOP"])
        elif choice == 2:
            self.sample(d)["loss_mask"][0] = self.rng.choice([2, -1, 7])
        else:
            d["samples"] = []
        return v, w, g, z(d), "malformed"

    def make_empty_prompt(self):
        v, w, g, d = self.rec()
        d["prompt_ids"] = []
        return v, w, g, z(d), "malformed"

    def make_length_mismatch(self):
        v, w, g, d = self.rec()
        s = self.sample(d)
        if self.rng.random() < 0.5:
            s["behavior_logprobs"] = s["behavior_logprobs"][:-1]
        else:
            s["loss_mask"] = s["loss_mask"] + [1]
        return v, w, g, z(d), "length_mismatch"

    # -- values the source checks against the run --------------------------------------------------------
    def make_nan_logprob(self):
        v, w, g, d = self.rec()
        s = self.sample(d)
        s["behavior_logprobs"][self.rng.randrange(len(s["behavior_logprobs"]))] = self.rng.choice(
            [float("nan"), float("inf"), float("-inf")])
        return v, w, g, z(d), "logprob_not_finite"

    def make_overflow_logprob(self):
        v, w, g, d = self.rec()
        s0 = d["samples"][0]
        for f in ("response_ids", "behavior_logprobs", "loss_mask"):
            s0[f] = s0[f][: MAX_NEW - 1]  # room for the token added below
        text = json.dumps(d).replace('"behavior_logprobs": [', '"behavior_logprobs": [-1e999, ', 1)
        text = text.replace('"response_ids": [', '"response_ids": [3, ', 1).replace('"loss_mask": [', '"loss_mask": [1, ', 1)
        return v, w, g, z(text), "logprob_not_finite"

    def make_nan_reward(self):
        v, w, g, d = self.rec()
        self.sample(d)["reward"] = self.rng.choice([float("nan"), float("inf"), float("-inf")])
        return v, w, g, z(d), "reward_not_finite"

    def make_positive_logprob(self):
        v, w, g, d = self.rec()
        self.sample(d)["behavior_logprobs"][0] = self.rng.choice([0.01, 0.5, 3.0, 1e30])
        return v, w, g, z(d), "logprob_positive"

    def make_out_of_vocab(self):
        v, w, g, d = self.rec()
        bad = self.rng.choice([VOCAB, VOCAB + 1, -1, -(2**40), 2**70, 10**30])
        if self.rng.random() < 0.5:
            d["prompt_ids"][self.rng.randrange(len(d["prompt_ids"]))] = bad
        else:
            s = self.sample(d)
            s["response_ids"][self.rng.randrange(len(s["response_ids"]))] = bad
        return v, w, g, z(d), "vocab"

    def make_too_long(self):
        v, w, g, d = self.rec()
        s = self.sample(d)
        k = self.rng.choice([MAX_NEW + 1, 100, 50_000])
        s.update(response_ids=[1] * k, behavior_logprobs=[-1.0] * k, loss_mask=[1] * k)
        return v, w, g, z(d), "too_long"

    def make_future(self):
        v, w, g, d = self.rec(CURRENT)
        d["policy_version"] = CURRENT + self.rng.choice([1, 2, 1000, 10**12])
        return v, w, g, z(d), "future_version"

    def make_stale(self):
        v, w, g, d = self.rec()
        d["policy_version"] = self.rng.randint(1, WINDOW.start - 1)
        return v, w, g, z(d), "stale"

    def make_wrong_run(self):
        v, w, g, d = self.rec()
        d["run"] = self.rng.choice(["other-run", "", RUN + "x", "../" + RUN])
        return v, w, g, z(d), "wrong_run"

    def make_key_mismatch(self):
        v, w, g, d = self.rec()
        which = self.rng.randrange(3)
        if which == 0:
            d["policy_version"] = self.rng.choice([x for x in WINDOW if x != v])
        elif which == 1:
            d["worker_id"] = w + "x"
        else:
            d["group_id"] = g + "x"
        return v, w, g, z(d), "key_mismatch"

    def make_wrong_plane(self):
        v, w, g, d = self.rec()
        d["plane"] = "int8g64"
        return v, w, g, z(d), "wrong_plane"

    def make_wrong_task(self):
        v, w, g, d = self.rec()
        d["task"] = "psqa" if d["task"] != "psqa" else "gsm8k"  # a registered task, not the run's
        return v, w, g, z(d), "wrong_task"

    def make_group_size(self):
        v, w, g, d = self.rec()
        k = self.rng.choice([1, 2, 3, 5, 8, 64])
        d["samples"] = [copy.deepcopy(d["samples"][i % N]) for i in range(k)]
        return v, w, g, z(d), "group_size"

    def make_sampling(self):
        v, w, g, d = self.rec()
        field, value = self.rng.choice([("temperature", 0.7), ("top_p", 0.9), ("max_new_tokens", MAX_NEW + 1),
                                        ("temperature", 1e-9)])
        d["sampling"][field] = value
        return v, w, g, z(d), "sampling_mismatch"


def _value_at(d: dict, field: str):
    """The value of a `"name": ` field as it appears first in json.dumps(d) (top level, then sampling, samples)."""
    name = json.loads("{" + field + "0}").popitem()[0]
    for where in (d, d["sampling"], d["samples"][0]):
        if name in where:
            return where[name]
    raise KeyError(name)


#: record kinds and their relative weights (the expensive ones are added by count, not weight)
KINDS = {
    "not_zstd": 4, "truncated": 4, "not_json": 4, "not_utf8": 1, "not_object": 2, "schema_version": 3,
    "missing_field": 6, "extra_field": 5, "wrong_type": 8, "wrong_element_type": 4, "deep_nesting": 3,
    "duplicate_json_key": 4, "bad_enum": 4, "empty_prompt": 2, "length_mismatch": 4, "nan_logprob": 5,
    "overflow_logprob": 2, "nan_reward": 3, "positive_logprob": 3, "out_of_vocab": 6, "too_long": 3,
    "future": 5, "stale": 4, "wrong_run": 3, "key_mismatch": 4, "wrong_plane": 3, "wrong_task": 3, "group_size": 4,
    "sampling": 3, "forged_size": 1, "routes_on_dense": 3,
}
#: counts of the costly kinds, whatever the total
COSTLY = {"bomb": 4, "oversized": 2, "huge_within_limits": 2}


def build(total: int, seed: int) -> tuple[list[tuple[str, bytes]], Counter, Counter, set[str]]:
    """(key, blob) pairs in memory, the drop reasons they must produce (per reason and per worker), and the
    keys of the valid controls. Includes bad keys and duplicate groups (same worker/group id, second key)."""
    gen = Gen(seed)
    items: list[tuple[str, bytes]] = []
    expect: Counter = Counter()
    per_worker: Counter = Counter()
    controls: set[str] = set()

    def add(v, w, g, blob, reason):
        key = layout.rollout_key(RUN, v, w, g)
        items.append((key, blob))
        if reason is None:
            controls.add(key)
        else:
            expect[reason] += 1
            per_worker[w] += 1

    for kind, count in COSTLY.items():
        for _ in range(count):
            add(*getattr(gen, f"make_{kind}")())
    n_controls = max(8, total // 200)
    for _ in range(n_controls // 2):  # a valid group, and the same worker/group id under a second key
        v, w, g, d = gen.rec(CURRENT - 1)
        add(v, w, g, z(d), None)
        d2 = {**d, "policy_version": CURRENT}
        add(CURRENT, w, g, z(d2), "duplicate")
    for _ in range(n_controls - n_controls // 2):
        v, w, g, d = gen.rec()
        add(v, w, g, z(d), None)
    n_bad_keys = max(4, total // 100)
    for _ in range(n_bad_keys):  # well-formed records under keys that are not rollout keys
        v, w, g, d = gen.rec()
        prefix = layout.rollout_version_prefix(RUN, v)
        key = gen.rng.choice([f"{prefix}{w}/{g}.json", f"{prefix}{w}/sub/{g}.json.zst", f"{prefix}{g}.json.zst",
                              f"{prefix}_{w}/{g}.json.zst", f"{prefix}{w}/{g}.json.zst.bak"])
        items.append((key, z(d)))
        expect["bad_key"] += 1
        per_worker["_other"] += 1
    names = sorted(KINDS)
    weights = [KINDS[k] for k in names]
    while len(items) < total:
        add(*getattr(gen, f"make_{gen.rng.choices(names, weights)[0]}")())
    return items, expect, per_worker, controls


def write_bulk(root: Path, items: list[tuple[str, bytes]]) -> None:
    """Write objects straight into the file store's tree (key = path). A worker would use put_if_absent;
    that fsyncs every object, which only slows the test, and the reader side is what is under test."""
    for key, blob in items:
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark for this process (Linux clear_refs 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def fuzz(tmp_path: Path, total: int, seed: int) -> dict:
    t0 = time.monotonic()
    items, expect, per_worker, controls = build(total, seed)
    store = FileStore(tmp_path / "bucket")
    write_bulk(store.root, items)
    built_s = time.monotonic() - t0
    del items
    gc.collect()
    rules = RecordRules(run=RUN, n_samples=N, plane="bf16", vocab_size=VOCAB, temperature=1.0, top_p=1.0,
                        max_new_tokens=MAX_NEW, staleness=STALENESS, task="arithmetic")
    src = RolloutSource(store, rules, BatchRules(groups_per_step=4, reuse_cap=2))
    if not _reset_peak():
        pytest.skip("this kernel cannot reset the peak-RSS mark (/proc/self/clear_refs)")
    base = _rss_mb()
    t1 = time.monotonic()
    added = src.poll(CURRENT)  # would raise on any record that escaped validation
    poll_s = time.monotonic() - t1
    peak = _peak_mb() - base
    gc.collect()
    retained = _rss_mb() - base

    assert added == len(controls) == src.accepted
    assert set(src._pool) == controls  # exactly the valid ones, none of the hostile ones
    got = Counter({k: v for k, v in src.drops.items() if v})
    assert got == expect, {k: (got.get(k, 0), expect.get(k, 0)) for k in set(got) | set(expect)
                           if got.get(k, 0) != expect.get(k, 0)}
    assert set(got) <= set(DROP_REASONS)
    stats = src.worker_stats()
    assert len(stats) <= MAX_TRACKED_WORKERS + 1  # per-worker state is bounded too
    assert sum(sum(s["drops"].values()) for s in stats.values()) == sum(expect.values())
    for w in [w for w in per_worker if w in stats and w != "_other"][:200]:
        assert sum(stats[w]["drops"].values()) == per_worker[w], w
    m = src.metrics()
    assert m["rollout/dropped"] == sum(expect.values())
    # bounded: one decompressed record's worth (the 128 MiB cap) plus the Python objects of the largest
    # legal record, not anything that grows with the number of records
    assert peak < 400, f"peak RSS grew {peak:.0f} MB while reading {total} records"
    assert retained < 100, f"{retained:.0f} MB still held after reading {total} records"
    return {"records": total, "hostile": sum(expect.values()), "controls": len(controls),
            "reasons": dict(sorted(expect.items())), "peak_rss_growth_mb": round(peak, 1),
            "retained_rss_mb": round(retained, 1), "build_s": round(built_s, 1), "poll_s": round(poll_s, 1),
            "workers_tracked": len(stats), "source": src}


def _learner_step_on(src: RolloutSource, tmp_path: Path) -> float:
    """The learner still trains: a batch from what survived, one real step of the tiny model."""
    import torch
    from learner_fixtures import recipe, tiny_model

    from trainer.backends import get_backend
    from trainer.objectives import policy_loss
    from trainer.step import collate

    torch.set_num_threads(1)
    batch = src.take_batch(CURRENT)
    assert batch is not None and len(batch.groups) == 4
    model_dir = tmp_path / "tiny"
    tiny_model().save_pretrained(str(model_dir))
    cfg = recipe()
    backend = get_backend("hf").load(str(model_dir), cfg, device="cpu")
    tb = collate([g.record for g in batch.groups])
    tb.ref_logp = backend.logprobs(tb, reference=True)
    out = backend.train_step(tb, lambda lp, mb: policy_loss(lp, mb.behavior_logp, mb.ref_logp, mb.advantages,
                                                            mb.loss_mask, cfg.algo))
    return float(out["loss"])


def test_10k_hostile_records_are_each_dropped_with_their_reason(tmp_path):
    figures = fuzz(tmp_path, 10_000, seed=1)
    src = figures.pop("source")
    # every reason one record can earn on its own (reuse_cap and vanished need a consumer / a deleter; the
    # routes of an MoE run have their own test below)
    assert set(figures["reasons"]) == set(DROP_REASONS) - {"reuse_cap", "vanished"} - MOE_ONLY
    print({k: v for k, v in figures.items() if k != "reasons"})
    assert math.isfinite(_learner_step_on(src, tmp_path))


@pytest.mark.soak
def test_soak_hostile_records(tmp_path):
    trials = max(2, soak_trials(20) // 10)  # 10,000 records a trial: a tenth of the crash trials' count
    totals: Counter = Counter()
    runs = []
    for t in range(trials):
        sub = tmp_path / f"t{t}"
        figures = fuzz(sub, 10_000, seed=1000 + t)
        _learner_step_on(figures.pop("source"), sub)
        totals.update(figures["reasons"])
        runs.append(figures)
        shutil.rmtree(sub)
    record("fuzz", {"trials": trials, "records": sum(r["records"] for r in runs),
                    "hostile_dropped": sum(r["hostile"] for r in runs),
                    "controls_accepted": sum(r["controls"] for r in runs), "learner_crashes": 0,
                    "reasons": dict(sorted(totals.items())),
                    "peak_rss_growth_mb_max": max(r["peak_rss_growth_mb"] for r in runs),
                    "retained_rss_mb_max": max(r["retained_rss_mb"] for r in runs),
                    "poll_s_mean": round(sum(r["poll_s"] for r in runs) / trials, 1)})


# -- MoE routes (worker_contract/routes.py): hostile routes on a run that replays them ---------------------
MOE = RouteShape(moe_layers=(1, 2, 3), num_experts=8, top_k=2)
MOE_ONLY = {"routes_missing", "routes_shape", "routes_range"}


def _ids(rng: random.Random, tokens: int, shape: RouteShape) -> np.ndarray:
    return np.array([[sorted(rng.sample(range(shape.num_experts), shape.top_k)) for _ in shape.moe_layers]
                     for _ in range(tokens)], dtype=np.uint8).reshape(tokens, shape.layers, shape.top_k)


def _routes_for(d: dict, rng: random.Random, shape: RouteShape, extra: int = 0) -> dict:
    """The routes a worker would record for record dict `d` (`extra` more tokens on the last sample)."""
    prompt = _ids(rng, len(d["prompt_ids"]), shape)
    samples = [_ids(rng, routed_response_tokens(s["loss_mask"]), shape) for s in d["samples"]]
    samples[-1] = np.concatenate([samples[-1], _ids(rng, extra, shape)])
    return {"schema_version": 2, "routes": encode_routes(prompt, samples).model_dump()}


def _raw_routes(ids: np.ndarray, shape: RouteShape) -> dict:
    frame = zstandard.ZstdCompressor().compress(np.ascontiguousarray(ids, dtype=np.uint8).tobytes())
    return {"layers": shape.layers, "top_k": shape.top_k, "data": base64.b64encode(frame).decode()}


@functools.cache
def _routes_bomb() -> str:
    return base64.b64encode(zstandard.ZstdCompressor().compress(bytes(64 << 20))).decode()


def _hostile_routes(rng: random.Random, d: dict) -> tuple[dict, str]:
    """d with routes wrong in one known way, and the reason it must be dropped for."""
    kind = rng.choice(["missing", "layers", "top_k", "count_short", "count_long", "id_range", "repeated",
                       "not_base64", "not_zstd", "bomb", "v1_with_routes", "v2_without"])
    ok = _routes_for(d, rng, MOE)
    n_tokens = len(d["prompt_ids"]) + sum(routed_response_tokens(s["loss_mask"]) for s in d["samples"])
    ids = _ids(rng, n_tokens, MOE)
    if kind == "missing":
        return d, "routes_missing"
    if kind == "layers":
        other = RouteShape(tuple(range(MOE.layers + 1)), MOE.num_experts, MOE.top_k)
        return {**d, **_routes_for(d, rng, other)}, "routes_shape"
    if kind == "top_k":
        other = RouteShape(MOE.moe_layers, MOE.num_experts, MOE.top_k + 1)
        return {**d, **_routes_for(d, rng, other)}, "routes_shape"
    if kind in ("count_short", "count_long"):  # one token too few or too many: the off-by-one a recorder makes
        cut = ids[:-1] if kind == "count_short" else np.concatenate([ids, ids[:1]])
        return {**d, "schema_version": 2, "routes": _raw_routes(cut, MOE)}, "routes_shape"
    if kind == "id_range":
        ids[rng.randrange(n_tokens), rng.randrange(MOE.layers), -1] = rng.choice([MOE.num_experts, 255])
        return {**d, "schema_version": 2, "routes": _raw_routes(ids, MOE)}, "routes_range"
    if kind == "repeated":
        t, layer = rng.randrange(n_tokens), rng.randrange(MOE.layers)
        ids[t, layer, 1] = ids[t, layer, 0]
        return {**d, "schema_version": 2, "routes": _raw_routes(ids, MOE)}, "routes_range"
    if kind == "not_base64":
        return {**d, **ok, "routes": {**ok["routes"], "data": "@@not base64@@"}}, "routes_shape"
    if kind == "not_zstd":
        junk = base64.b64encode(rng.randbytes(40)).decode()
        return {**d, **ok, "routes": {**ok["routes"], "data": junk}}, "routes_shape"
    if kind == "bomb":  # a frame claiming far more than the tokens need
        return {**d, **ok, "routes": {**ok["routes"], "data": _routes_bomb()}}, "routes_shape"
    if kind == "v1_with_routes":
        return {**d, **ok, "schema_version": 1}, "malformed"
    return {**d, "schema_version": 2}, "malformed"  # v2_without


def test_hostile_routes_on_an_moe_run_are_each_dropped_with_their_reason(tmp_path):
    """An MoE run that replays routes: every hostile route is dropped with its reason, valid routed groups
    are pooled, and the learner keeps polling."""
    rng = random.Random(7)
    gen = Gen(7)
    store = FileStore(tmp_path / "bucket")
    expect: Counter = Counter()
    controls = set()
    for i in range(400):
        v, w, g, d = gen.rec()
        if i % 4 == 0:
            d, reason = {**d, **_routes_for(d, rng, MOE)}, None
        else:
            d, reason = _hostile_routes(rng, d)
        key = layout.rollout_key(RUN, v, w, g)
        store.put(key, z(d))
        if reason is None:
            controls.add(key)
        else:
            expect[reason] += 1
    rules = RecordRules(run=RUN, n_samples=N, plane="bf16", vocab_size=VOCAB, temperature=1.0, top_p=1.0,
                        max_new_tokens=MAX_NEW, staleness=STALENESS, routes=MOE, replay=True, task="arithmetic")
    src = RolloutSource(store, rules, BatchRules(groups_per_step=4, reuse_cap=2))
    assert src.poll(CURRENT) == len(controls)
    assert set(src._pool) == controls
    assert Counter({k: v for k, v in src.drops.items() if v}) == expect
    assert MOE_ONLY <= set(expect)
    # the same routes on a run that does not replay: a group without routes is fine there, hostile ones are not
    lax = RecordRules(**{**rules.__dict__, "replay": False})
    rec = decode_record(z(gen.rec()[3]))
    assert lax.check(rec, layout.parse_rollout_key(layout.rollout_key(RUN, rec.policy_version, rec.worker_id,
                                                                      rec.group_id)), CURRENT) is None
