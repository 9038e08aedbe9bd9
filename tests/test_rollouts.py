"""The rollout source: validation with counted reasons, window-bounded listing, reuse cap and its ledger."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import zstandard

from trainer.rollouts.pool import DROP_REASONS, BatchRules, RecordRules
from trainer.rollouts.source import RolloutSource
from worker_contract import layout
from worker_contract.schema import RolloutRecord, encode_record
from worker_contract.store.file import FileStore

RUN = "t-run"
N = 4
VOCAB = 50


class CountingStore(FileStore):
    """A real file store that also records every listing it serves."""

    def __init__(self, root):
        super().__init__(root)
        self.lists: list[tuple[str, str | None]] = []

    def list(self, prefix="", start_after=None):
        self.lists.append((prefix, start_after))
        return super().list(prefix, start_after)


def record_dict(version=5, worker="w1", group="g1", **over) -> dict:
    samples = [
        {"response_ids": [3, 4, 5], "behavior_logprobs": [-0.5, -1.0, -2.0], "loss_mask": [1, 1, 1],
         "reward": float(i % 2), "finish_reason": "stop"}
        for i in range(N)
    ]
    d = {"schema_version": 1, "run": RUN, "worker_id": worker, "group_id": group, "policy_version": version,
         "plane": "bf16", "task": "arithmetic", "prompt_id": f"p-{group}", "prompt_ids": [1, 2],
         "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16}, "samples": samples,
         "created_at": 0.0}
    d.update(over)
    return d


def raw(d: dict) -> bytes:
    """Compress a record dict as-is (bypasses the model, so invalid records can be written)."""
    return zstandard.ZstdCompressor().compress(json.dumps(d).encode())


def put_record(store, d: dict, *, key_version=None, key_worker=None, key_group=None, blob=None) -> str:
    key = layout.rollout_key(RUN, key_version or d["policy_version"], key_worker or d["worker_id"],
                             key_group or d["group_id"])
    store.put_if_absent(key, blob if blob is not None else encode_record(RolloutRecord.model_validate(d)))
    return key


def source(store, *, reuse_cap=2, groups_per_step=3, sweep_every=10, read_threads=16, **kw) -> RolloutSource:
    rules = dict(run=RUN, n_samples=N, plane="bf16", vocab_size=VOCAB, temperature=1.0, top_p=1.0,
                 max_new_tokens=16, staleness=3)
    rules.update(kw)
    return RolloutSource(store, RecordRules(**rules), BatchRules(groups_per_step=groups_per_step,
                                                                 reuse_cap=reuse_cap), sweep_every=sweep_every,
                         read_threads=read_threads)


def _sample_edit(field, value, i=0):
    def edit(d):
        d["samples"][i][field] = value
        return d
    return edit


# reason, how the record dict is broken (None = raw bytes given), extra put arguments
BAD = [
    ("malformed", None, {"blob": b"this is not zstd"}),
    ("malformed", None, {"blob": zstandard.ZstdCompressor().compress(b"{not json")}),
    ("malformed", lambda d: {k: v for k, v in d.items() if k != "prompt_ids"}, {}),
    ("malformed", _sample_edit("loss_mask", [1, 2, 1]), {}),
    ("malformed", lambda d: {**d, "prompt_ids": []}, {}),
    ("schema_version", lambda d: {**d, "schema_version": 3}, {}),
    ("malformed", lambda d: {**d, "schema_version": 2}, {}),  # version 2 carries MoE routes; this one has none
    ("length_mismatch", _sample_edit("behavior_logprobs", [-0.5, -1.0]), {}),
    ("wrong_run", lambda d: {**d, "run": "other-run"}, {}),
    ("future_version", lambda d: {**d, "policy_version": 6}, {"key_version": 5}),
    ("stale", lambda d: {**d, "policy_version": 1}, {"key_version": 5}),
    ("key_mismatch", lambda d: {**d, "policy_version": 4}, {"key_version": 5}),
    ("key_mismatch", lambda d: {**d, "worker_id": "w-other"}, {"key_worker": "w1"}),
    ("key_mismatch", lambda d: {**d, "group_id": "g-other"}, {"key_group": "gx"}),
    ("wrong_plane", lambda d: {**d, "plane": "int8g64"}, {}),
    ("group_size", lambda d: {**d, "samples": d["samples"][:3]}, {}),
    ("sampling_mismatch", lambda d: {**d, "sampling": {**d["sampling"], "temperature": 0.7}}, {}),
    ("sampling_mismatch", lambda d: {**d, "sampling": {**d["sampling"], "max_new_tokens": 32}}, {}),
    ("vocab", _sample_edit("response_ids", [3, VOCAB, 5]), {}),
    ("vocab", lambda d: {**d, "prompt_ids": [-1, 2]}, {}),
    ("logprob_not_finite", _sample_edit("behavior_logprobs", [-0.5, float("nan"), -1.0], i=3), {}),
    ("logprob_not_finite", _sample_edit("behavior_logprobs", [float("-inf"), -1.0, -1.0]), {}),
    ("logprob_positive", _sample_edit("behavior_logprobs", [-0.5, 0.5, -1.0]), {}),
    ("reward_not_finite", _sample_edit("reward", float("inf"), i=2), {}),
]


@pytest.mark.parametrize("read_threads", [1, 16])
def test_every_bad_record_is_dropped_with_its_reason_while_good_ones_are_used(tmp_path, read_threads):
    """Records read one at a time or 16 at once: the same verdicts, each drop reported once with its key."""
    store = FileStore(tmp_path)
    keyed: dict[str, str] = {}
    good = [put_record(store, record_dict(worker="good", group=f"ok{i}", version=4 + i % 2)) for i in range(3)]
    expected: dict[str, int] = {}
    for i, (reason, edit, put_kw) in enumerate(BAD):
        d = record_dict(version=5, worker=f"bad{i}", group=f"b{i}")
        blob = put_kw.get("blob") or raw(edit(d))
        key = layout.rollout_key(RUN, put_kw.get("key_version", 5), put_kw.get("key_worker", f"bad{i}"),
                                 put_kw.get("key_group", f"b{i}"))
        store.put_if_absent(key, blob)
        keyed[key] = reason
        expected[reason] = expected.get(reason, 0) + 1
    # objects that never parse as a record key, and one too large to read
    store.put(f"{RUN}/rollouts/v0000000005/loose.json.zst", b"x")
    store.put(f"{RUN}/rollouts/v0000000005/w/g.json", b"x")
    store.put(layout.rollout_key(RUN, 5, "big", "g0"), os.urandom(5000))
    expected["bad_key"] = 2
    expected["oversized"] = 1
    keyed.update({f"{RUN}/rollouts/v0000000005/loose.json.zst": "bad_key", f"{RUN}/rollouts/v0000000005/w/g.json":
                  "bad_key", layout.rollout_key(RUN, 5, "big", "g0"): "oversized"})

    src = source(store, max_record_bytes=4096, read_threads=read_threads)
    journal: list[tuple[str, str]] = []
    src.tally.on_drop = lambda key, reason: journal.append((key, reason))
    assert src.poll(5) == 3
    assert sorted(journal) == sorted(keyed.items())
    batch = src.take_batch(5)
    assert batch is not None and sorted(g.key for g in batch.groups) == sorted(good)
    assert {r: n for r, n in src.drops.items() if n} == expected
    assert set(expected) <= set(DROP_REASONS)
    stats = src.worker_stats()
    assert stats["good"]["groups"] == 3 and stats["good"]["used"] == 3
    bad_lengths = [i for i, row in enumerate(BAD) if row[0] == "length_mismatch"]
    assert [stats[f"bad{i}"]["drops"] for i in bad_lengths] == [{"length_mismatch": 1}]
    m = src.metrics()
    assert m["rollout/drops/vocab"] == 2 and m["worker/good/groups"] == 3
    assert batch.metrics["rollout/raw_reward"] == 0.5
    assert batch.metrics["rollout/staleness_hist/0"] == 1 and batch.metrics["rollout/staleness_hist/1"] == 2


def test_listing_is_confined_to_the_staleness_window(tmp_path):
    store = CountingStore(tmp_path)
    for v in range(1, 21):  # a long history: 20 versions x 2 groups
        for g in range(2):
            put_record(store, record_dict(version=v, group=f"g{v}-{g}"))
    src = source(store, staleness=3, sweep_every=1000)
    src.poll(20)
    window = {layout.rollout_version_prefix(RUN, v) for v in range(17, 21)}
    assert {p for p, _ in store.lists} == window and len(store.lists) == 4
    assert src.accepted == 8  # only the window's groups were read
    # the next poll lists from the last key seen in each prefix
    store.lists.clear()
    src.poll(20)
    assert len(store.lists) == 4 and all(after is not None and after.startswith(p) for p, after in store.lists)
    # the window moves with the version; prefixes that left it are listed whole one last time (to count
    # the groups never read), then never again
    store.lists.clear()
    src.poll(22)
    left = [layout.rollout_version_prefix(RUN, v) for v in (17, 18)]
    window = {layout.rollout_version_prefix(RUN, v) for v in range(19, 23)}
    assert [(p, a) for p, a in store.lists if p not in window] == [(p, None) for p in left]
    store.lists.clear()
    src.poll(22)
    assert {p for p, _ in store.lists} == window and len(store.lists) == 4


def test_a_late_upload_that_sorts_before_the_last_seen_key_is_found_by_the_sweep(tmp_path):
    store = CountingStore(tmp_path)
    put_record(store, record_dict(version=5, worker="zz", group="g1"))
    src = source(store, sweep_every=3, groups_per_step=1)
    assert src.poll(5) == 1
    late = put_record(store, record_dict(version=5, worker="aa", group="g1"))
    assert src.poll(5) == 0  # start_after skips it
    assert src.poll(5) == 1  # the sweep (every 3rd poll) lists the prefix whole
    assert src.poll(5) == 0 and src.accepted == 2  # and nothing is taken twice
    assert late in src._pool


def test_a_group_is_used_at_most_reuse_cap_times_and_the_ledger_survives_a_restart(tmp_path):
    store = FileStore(tmp_path)
    keys = [put_record(store, record_dict(version=5, group=f"g{i}")) for i in range(3)]
    src = source(store, groups_per_step=3)
    b1, b2 = src.next_batch(5), src.next_batch(5)
    assert [g.use for g in b1.groups] == [1, 1, 1] and [g.use for g in b2.groups] == [2, 2, 2]
    assert src.next_batch(5) is None
    state = json.loads(json.dumps(src.ledger_state()))
    assert state["uses"] == {k: 2 for k in keys}

    # a restart that resumes from a checkpoint taken after the first batch may use each group once more
    after_first = {"version": 1, "reuse_cap": 2, "uses": {k: 1 for k in keys}}
    again = source(store, groups_per_step=3)
    again.load_ledger_state(after_first)
    b = again.next_batch(5)
    assert [g.use for g in b.groups] == [2, 2, 2] and again.next_batch(5) is None
    # one resumed from the final state drops every group as used up
    spent = source(store, groups_per_step=3)
    spent.load_ledger_state(state)
    assert spent.next_batch(5) is None and spent.drops["reuse_cap"] == 3


def test_fresh_groups_go_first_and_unused_groups_that_age_out_count_as_stale(tmp_path):
    store = FileStore(tmp_path)
    put_record(store, record_dict(version=2, group="old"))
    put_record(store, record_dict(version=3, group="mid"))
    src = source(store, groups_per_step=1)
    assert src.next_batch(3).groups[0].record.group_id == "mid"  # newest policy first
    put_record(store, record_dict(version=4, group="new"))
    assert src.next_batch(4).groups[0].record.group_id == "new"  # fresh before reused
    assert src.next_batch(4).groups[0].record.group_id == "old"  # unused before reused
    # at version 7 the window is 4..7: "mid" (used once) retires quietly, nothing unused was lost
    src.poll(7)
    assert src.drops["stale"] == 0
    put_record(store, record_dict(version=7, group="never"))
    src.poll(7)
    src.poll(11)  # "never" (version 7) leaves the window unused
    assert src.drops["stale"] == 1


def test_groups_uploaded_after_the_last_poll_count_as_stale_when_their_version_leaves_the_window(tmp_path):
    store = CountingStore(tmp_path / "a")
    put_record(store, record_dict(version=1, group="history"))  # never inside any window of this source
    put_record(store, record_dict(version=5, worker="w1", group="used"))
    src = source(store, groups_per_step=1, sweep_every=1000)
    assert src.poll(5) == 1 and src.take_batch(5).groups[0].record.group_id == "used"
    # uploaded after that poll: one under a worker id that sorts before the last key seen
    put_record(store, record_dict(version=5, worker="w2", group="late"))
    put_record(store, record_dict(version=5, worker="aa", group="early-id"))
    put_record(store, record_dict(version=4, worker="w1", group="late4"))
    store.lists.clear()
    src.poll(9)  # window 6..9: versions 2..5 leave it, each listed whole once, unread groups counted
    gone = [layout.rollout_version_prefix(RUN, v) for v in range(2, 6)]
    assert [(p, a) for p, a in store.lists if p in gone] == [(p, None) for p in gone]
    assert src.drops == {"stale": 3}
    assert {w: s["drops"] for w, s in src.worker_stats().items()} == {
        "w1": {"stale": 1}, "w2": {"stale": 1}, "aa": {"stale": 1}}
    m = src.metrics()
    assert m["rollout/drops/stale"] == 3 and m["rollout/dropped"] == 3
    # counted once: later polls list only the window, and version 1 was never listed at all
    store.lists.clear()
    src.poll(9)
    src.poll(10)
    assert all(layout.parse_rollout_key(p + "w/g.json.zst").version >= 6 for p, _ in store.lists)
    assert src.drops == {"stale": 3}

    # a failed last listing is retried at the next poll, so the count is not lost
    broken = BrokenListStore(tmp_path / "b")
    broken.fail = False
    src = source(broken, groups_per_step=1)
    assert src.poll(5) == 0
    put_record(broken, record_dict(version=5, group="late"))
    broken.fail = True
    src.poll(9)
    assert src.drops["stale"] == 0
    broken.fail = False
    src.poll(9)
    assert src.drops == {"stale": 1}


def test_groups_landing_below_the_window_after_their_version_left_it_count_as_stale(tmp_path):
    """A batch sampled at v that lands once the learner is past v + staleness (a slow worker): its prefix
    already left the window, yet its groups are counted as stale drops, unread, once each; the extra listing
    is bounded (the watched prefixes on sweeps, one last listing as each leaves the watch)."""
    store = CountingStore(tmp_path)
    put_record(store, record_dict(version=5, worker="w1", group="used"))
    src = source(store, groups_per_step=1, sweep_every=3)  # staleness 3: watched for 8 versions below the window
    window = lambda cur: {layout.rollout_version_prefix(RUN, v) for v in range(cur - 3, cur + 1)}  # noqa: E731
    watched = {layout.rollout_version_prefix(RUN, v) for v in range(2, 6)}
    assert src.poll(5) == 1 and src.take_batch(5) is not None  # poll 1
    src.poll(9)  # poll 2: versions 2..5 leave the window, each listed whole once (nothing unread yet)
    assert src.drops["stale"] == 0
    # the slow worker's batch, sampled at v5 and v4, lands now: below the window [6, 9]
    late = [put_record(store, record_dict(version=5, worker="w2", group=f"late{i}")) for i in range(2)]
    late.append(put_record(store, record_dict(version=4, worker="aa", group="late4")))
    journal: list[tuple[str, str]] = []
    src.tally.on_drop = lambda key, reason: journal.append((key, reason))
    store.lists.clear()
    src.poll(9)  # poll 3, a sweep: the window and the watched prefixes, listed whole
    assert sorted(journal) == sorted((k, "stale") for k in late)
    assert {p for p, _ in store.lists} == window(9) | watched and len(store.lists) == 8
    assert src.accepted == 1  # counted unread
    assert {w: s["drops"] for w, s in src.worker_stats().items() if s["drops"]} == {
        "w2": {"stale": 2}, "aa": {"stale": 1}}
    assert src.metrics()["rollout/drops/stale"] == 3
    # counted once; a poll that is no sweep lists only the window
    store.lists.clear()
    src.poll(9)  # poll 4
    assert {p for p, _ in store.lists} == window(9) and len(store.lists) == 4
    src.poll(9)
    src.poll(9)  # poll 6, a sweep
    assert src.drops["stale"] == 3
    # a group landing between sweeps is counted by the last listing as its version leaves the watch
    gone = put_record(store, record_dict(version=2, worker="w3", group="very-late"))
    store.lists.clear()
    src.poll(14)  # poll 7, no sweep: v2 < 14 - 3 - 8 leaves the watch; 6..10 leave the window
    assert (layout.rollout_version_prefix(RUN, 2), None) in store.lists
    assert not {p for p, _ in store.lists} & {layout.rollout_version_prefix(RUN, v) for v in (3, 4, 5)}
    assert journal[-1] == (gone, "stale") and src.drops["stale"] == 4
    # after that it is never listed again: later uploads there are not counted (the count is a floor)
    put_record(store, record_dict(version=2, worker="w3", group="too-late"))
    store.lists.clear()
    for _ in range(3):
        src.poll(14)
    assert all(layout.parse_rollout_key(p + "w/g.json.zst").version >= 3 for p, _ in store.lists)
    assert src.drops["stale"] == 4


def test_duplicate_group_under_a_second_key_is_dropped(tmp_path):
    store = FileStore(tmp_path)
    put_record(store, record_dict(version=4, group="same"))
    put_record(store, record_dict(version=5, group="same"))
    src = source(store, groups_per_step=1)
    assert src.poll(5) == 1 and src.drops["duplicate"] == 1


class VanishingStore(FileStore):
    """A real file store where another party deletes one object between its listing and its read."""

    victim = ""

    def list(self, prefix="", start_after=None):
        infos = list(super().list(prefix, start_after))
        if any(i.key == self.victim for i in infos):
            self.delete(self.victim)
        return iter(infos)


class BrokenListStore(FileStore):
    fail = True

    def list(self, prefix="", start_after=None):
        if self.fail:
            from worker_contract.store import StoreError
            raise StoreError("503 slow down")
        return super().list(prefix, start_after)


def test_store_trouble_is_counted_or_retried_never_raised(tmp_path):
    store = VanishingStore(tmp_path / "a")
    store.victim = put_record(store, record_dict(group="gone"))
    put_record(store, record_dict(group="stays"))
    src = source(store, groups_per_step=1)
    assert src.poll(5) == 1 and src.drops["vanished"] == 1

    broken = BrokenListStore(tmp_path / "b")
    put_record(broken, record_dict(group="g"))
    src = source(broken, groups_per_step=1)
    assert src.next_batch(5, timeout_s=0) is None
    broken.fail = False
    assert src.next_batch(5, timeout_s=0) is not None


def test_next_batch_waits_for_groups_and_stops_on_request(tmp_path):
    store = FileStore(tmp_path)
    src = source(store, groups_per_step=2)
    stop = threading.Event()
    timer = threading.Timer(0.2, lambda: [put_record(store, record_dict(group=f"g{i}")) for i in range(2)])
    timer.start()
    batch = src.next_batch(5, timeout_s=10, poll_interval_s=0.05, stop_event=stop)
    timer.join()
    assert batch is not None and len(batch.groups) == 2
    assert src.next_batch(5).groups[0].use == 2  # the second (last) use of both groups
    stop.set()
    t0 = time.monotonic()
    assert src.next_batch(5, timeout_s=10, poll_interval_s=5, stop_event=stop) is None
    assert time.monotonic() - t0 < 1.0


def test_bad_settings_and_ledgers_are_refused(tmp_path):
    with pytest.raises(ValueError, match="reuse_cap=0"):
        source(FileStore(tmp_path), reuse_cap=0)
    with pytest.raises(ValueError, match="consumption ledger"):
        source(FileStore(tmp_path)).load_ledger_state({"uses": []})


class HeldStore(FileStore):
    """A real file store whose read of one key takes as long as the network may: it is answered only once
    `release_after` other reads have been answered (or after `hold_s`), as a read that meets a slow
    connection or a retry's back-off is while the rest of the listing's reads go on."""

    held, release_after, hold_s = "", 0, 10.0

    def __init__(self, root):
        super().__init__(root)
        self.others_done = 0
        self.others_while_held = -1
        self._cond = threading.Condition()

    def get(self, key):
        data = super().get(key)
        with self._cond:
            if key != self.held:
                self.others_done += 1
                self._cond.notify_all()
                return data
            self._cond.wait_for(lambda: self.others_done >= self.release_after, timeout=self.hold_s)
            self.others_while_held = self.others_done
        return data


def test_a_slow_read_does_not_hold_back_the_reads_after_it(tmp_path):
    """Reads stay `read_threads` in flight: while the first record of a listing waits on the wire, the reads
    after it go on (up to `read_ahead` records ahead), and every record is still judged in listing order."""
    store = HeldStore(tmp_path)
    keys = [put_record(store, record_dict(worker=f"w{i:03d}", group="g")) for i in range(40)]
    store.held, store.release_after, store.hold_s = keys[0], 12, 10.0
    src = source(store, groups_per_step=40, read_threads=4)  # reads up to 4 x 4 records ahead
    t0 = time.monotonic()
    assert src.poll(5) == 40
    # 4 threads in 4-record chunks let only the 3 reads beside the held one finish; a sliding window, 12 or more
    assert store.others_while_held >= 12, store.others_while_held
    assert time.monotonic() - t0 < store.hold_s
    assert [g.key for g in src.take_batch(5).groups] == keys  # pooled (and so judged) in listing order


def test_the_runs_task_adds_its_batch_metrics_and_a_task_only_workers_know_adds_none(tmp_path):
    store = FileStore(tmp_path)
    for i in range(3):
        put_record(store, record_dict(group=f"g{i}", task="psqa"))
        put_record(store, record_dict(group=f"h{i}", task="known-to-workers-only"))
    psqa = source(store, task="psqa").next_batch(5)
    assert psqa.metrics["rollout/search_rate"] == 0.0  # every sample's mask is all ones: no tool turn
    # a task registered only in the workers' processes (a bench's, a user's own) is fine: no task metrics
    other = source(store, task="known-to-workers-only").next_batch(5)
    assert len(other.groups) == 3 and not any(k.startswith("rollout/search") for k in other.metrics)
