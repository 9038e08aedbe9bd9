"""An estimate of what a run costs in Cloudflare R2: storage (GB-month) and class A / class B operations.

R2 bills storage and operations, never egress (docs/r2-setup.md section 7). We cannot read the
account's bill from the bucket, so this module rebuilds the run's operations from what the bucket holds
(every object was at least one PUT, a large one a multipart upload) plus the documented polling habits of
the learner and the workers. Every assumption is a field of `UsageAssumptions`, printed with the estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from pydantic import BaseModel, ConfigDict, Field

from worker_contract import layout
from worker_contract.store import ObjectInfo, Store
from worker_contract.store.s3 import DEFAULT_PART_SIZE

GB = 1e9  # R2 bills decimal gigabytes
HOURS_PER_MONTH = 730.0

#: the first path segment under `<run>/` -> the prefix name shown to operators
PREFIXES = ("run.json", "current.json", "anchors", "versions", "rollouts", "stats", "probes")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class R2Prices(_Model):
    """R2 standard-class list prices (r2/pricing)."""

    storage_usd_per_gb_month: float = 0.015
    """Standard storage, per GB-month."""
    class_a_usd_per_million: float = 4.50
    """PUT, LIST, multipart create/part/complete: per million operations."""
    class_b_usd_per_million: float = 0.36
    """GET, HEAD: per million operations."""
    free_gb_month: float = 10.0
    """Monthly free storage of the whole account (not subtracted: other runs share it)."""
    free_class_a: float = 1e6
    """Monthly free class A operations of the account (not subtracted)."""
    free_class_b: float = 1e7
    """Monthly free class B operations of the account (not subtracted)."""


class UsageAssumptions(_Model):
    """How the learner and the workers use the bucket between the objects we can see."""

    learner_poll_interval_s: float = Field(2.0, gt=0)
    """How often the learner lists its staleness window while waiting (recipe train.poll_interval_s)."""
    learner_busy_fraction: float = Field(0.5, ge=0, le=1)
    """Share of wall time the learner is waiting (listing) rather than training."""
    worker_poll_interval_s: float = Field(5.0, gt=0)
    """How often a worker GETs the pointer."""
    multipart_threshold_bytes: int = Field(DEFAULT_PART_SIZE, gt=0)
    """Objects at least this large are uploaded in parts (the store's part size)."""
    multipart_part_bytes: int = Field(DEFAULT_PART_SIZE, gt=0)
    """Part size of a multipart upload."""


class PrefixUsage(_Model):
    """What one prefix of the run holds, and the PUT-side operations that wrote it."""

    objects: int = 0
    """Objects under the prefix."""
    bytes: int = 0
    """Their total size."""
    write_ops: int = 0
    """Class A operations that wrote them (1 per small object, parts + 2 per multipart one)."""


class BucketUsage(_Model):
    """The run's objects grouped by prefix (from one full, paginated listing)."""

    prefixes: dict[str, PrefixUsage] = {}
    """Prefix name (anchors, versions, rollouts, ...) -> its usage."""
    list_pages: int = 0
    """ListObjects pages this summary cost (1000 keys a page)."""

    @property
    def total_bytes(self) -> int:
        return sum(p.bytes for p in self.prefixes.values())

    def count(self, prefix: str) -> int:
        return self.prefixes[prefix].objects if prefix in self.prefixes else 0


def write_ops_for(size: int, a: UsageAssumptions) -> int:
    """Class A operations one upload of `size` bytes costs."""
    if size < a.multipart_threshold_bytes:
        return 1
    return 2 + math.ceil(size / a.multipart_part_bytes)  # create + parts + complete


def prefix_of(run: str, key: str) -> str:
    rest = key[len(layout.run_prefix(run)):]
    head = rest.split("/", 1)[0]
    return head if head in PREFIXES else "other"


def summarize_objects(run: str, objects: Iterable[ObjectInfo], a: UsageAssumptions,
                      advance: Callable[[float], None] = lambda n=1: None) -> BucketUsage:
    """Group a listing of the run by prefix; `advance` is called per object (progress bars)."""
    out = BucketUsage()
    n = 0
    for o in objects:
        p = out.prefixes.setdefault(prefix_of(run, o.key), PrefixUsage())
        p.objects += 1
        p.bytes += o.size
        p.write_ops += write_ops_for(o.size, a)
        n += 1
        advance(1)
    out.list_pages = max(1, math.ceil(n / 1000))
    return out


def bucket_usage(store: Store, run: str, a: UsageAssumptions | None = None,
                 advance: Callable[[float], None] = lambda n=1: None) -> BucketUsage:
    """One full listing of `<run>/` (paginated by the store), grouped by prefix."""
    return summarize_objects(run, store.list(layout.run_prefix(run)), a or UsageAssumptions(), advance)


class CostEstimate(_Model):
    """Estimated R2 cost of a run so far, and its current rate."""

    elapsed_h: float
    """Hours since run.json was created."""
    storage_gb: float
    """Bytes the run holds now, in GB."""
    gb_month_so_far: float
    """Storage used so far, assuming the run grew linearly to its current size."""
    class_a_ops: int
    """Class A operations so far (writes seen in the bucket + pointer updates + learner listings)."""
    class_b_ops: int
    """Class B operations so far (learner reads of records + worker pointer polls and weight downloads)."""
    usd_storage: float
    """Storage cost so far."""
    usd_class_a: float
    """Class A cost so far."""
    usd_class_b: float
    """Class B cost so far."""
    usd_total: float
    """Everything so far (before the account's free tier)."""
    usd_per_hour: float
    """Current rate: storage at today's size plus operations at the run's average pace."""
    class_a_per_hour: float
    """Class A operations per hour (average)."""
    class_b_per_hour: float
    """Class B operations per hour (average)."""
    assumptions: UsageAssumptions
    """What the operation counts rest on."""


def estimate_cost(
    usage: BucketUsage,
    *,
    elapsed_s: float,
    versions: int,
    workers: int,
    staleness: int,
    anchor_shards: int = 1,
    assumptions: UsageAssumptions | None = None,
    prices: R2Prices | None = None,
) -> CostEstimate:
    """Estimate the run's R2 cost from its bucket usage and the number of versions and workers.

    `versions` is the pointer's version (one pointer PUT each); `workers` the fleet size seen recently
    (each polls the pointer, downloads every patch and one anchor).
    """
    a, p = assumptions or UsageAssumptions(), prices or R2Prices()
    elapsed_s = max(elapsed_s, 1.0)
    writes = sum(u.write_ops for u in usage.prefixes.values())
    # The pointer is overwritten once per version but only its latest copy is listed.
    pointer_puts = max(versions - usage.count("current.json"), 0)
    learner_lists = elapsed_s * a.learner_busy_fraction / a.learner_poll_interval_s * (staleness + 1)
    class_a = writes + pointer_puts + learner_lists + usage.list_pages
    record_reads = usage.count("rollouts")
    worker_polls = workers * elapsed_s / a.worker_poll_interval_s
    weight_reads = workers * (usage.count("versions") + anchor_shards + 1)  # patches + one anchor
    class_b = record_reads + worker_polls + weight_reads
    gb = usage.total_bytes / GB
    hours = elapsed_s / 3600
    gb_month = gb * (hours / HOURS_PER_MONTH) / 2
    usd_s = gb_month * p.storage_usd_per_gb_month
    usd_a = class_a / 1e6 * p.class_a_usd_per_million
    usd_b = class_b / 1e6 * p.class_b_usd_per_million
    rate = gb * p.storage_usd_per_gb_month / HOURS_PER_MONTH + (usd_a + usd_b) / hours
    return CostEstimate(
        elapsed_h=hours, storage_gb=gb, gb_month_so_far=gb_month,
        class_a_ops=round(class_a), class_b_ops=round(class_b),
        usd_storage=usd_s, usd_class_a=usd_a, usd_class_b=usd_b, usd_total=usd_s + usd_a + usd_b,
        usd_per_hour=rate, class_a_per_hour=class_a / hours, class_b_per_hour=class_b / hours,
        assumptions=a,
    )


def storage_usd_per_month(nbytes: int, prices: R2Prices | None = None) -> float:
    """What keeping `nbytes` costs per month (gc reports what it saves)."""
    return nbytes / GB * (prices or R2Prices()).storage_usd_per_gb_month
