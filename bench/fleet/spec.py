"""What one fleet run is: how many workers of which kinds, how fast they work, what the wire does, and how
the learner stand-in consumes. One frozen dataclass, printed into the results with the figures."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

#: a real fleet's sizes, as measured (bench/results/pulse_gpu.json): a Qwen2.5-1.5B-shaped state in the bf16
#: plane (its `state_bytes`, the anchor) and the patch of one Adam-like step at lr 1e-6 (its `patch_bytes`)
REAL_ANCHOR_BYTES = 3_087_428_608
REAL_PATCH_BYTES = 42_049_636

#: worker kinds besides `honest`: what each does differently (the share of each is a field of FleetSpec)
KINDS = {
    "honest": "follows the pointer before every group, uploads at the spec's pace",
    "slow": "takes `slow_factor` times as long per group (its groups arrive late, some stale)",
    "stale": "joins, then never follows the pointer (its groups age out of the window)",
    "crashy": "after each group crashes with probability `crash_p`, restarts after a pause and cold-joins",
    "hostile": "its first group brings one bad record of each of the 8 kinds; then every other upload is one, in turn",
}


@dataclass(frozen=True)
class FleetSpec:
    workers: int = 256
    """Simulated workers (threads, spread over `worker_procs` processes), each its own client and identity."""
    duration_s: float = 150.0
    """Wall time the fleet works before the final drain."""
    ramp_s: float = 20.0
    """Workers' first joins are spread uniformly over this long."""
    group_s: float = 30.0
    """Mean seconds an honest worker takes per group (uniform within +-30%)."""
    slow: float = 0.10
    stale: float = 0.04
    crashy: float = 0.10
    hostile: float = 0.04
    """Shares of the kinds in KINDS; the rest are honest."""
    slow_factor: float = 3.0
    crash_p: float = 0.25
    restart_s: tuple[float, float] = (2.0, 8.0)
    n_samples: int = 8
    prompt_tokens: tuple[int, int] = (60, 200)
    response_tokens: tuple[int, int] = (64, 384)
    """Token counts drawn per group / per sample: records of realistic size (about 24 KB compressed)."""
    vocab_size: int = 151936
    max_new_tokens: int = 512
    # the learner stand-in
    groups_per_step: int = 0
    """Groups per learner step; 0 = max(8, workers // 4) (a larger fleet, a larger batch)."""
    step_s: float = 5.0
    """The learner's compute per step (a sleep: the GPU's part)."""
    poll_interval_s: float = 2.0
    """The rollout source's background poll interval (the recipe's train.poll_interval_s)."""
    staleness: int = 3
    reuse_cap: int = 2
    anchor_interval: int = 10
    tensors: int = 8
    tensor_shape: tuple[int, int] = (128, 256)
    """The published model: `tensors` float32 matrices of this shape (small: 256 workers hold a copy each)."""
    change_frac: float = 0.02
    """Share of weights a learner step changes (a PULSE patch carries only those)."""
    source_options: dict = field(default_factory=dict)
    """Extra keyword arguments of the RolloutSource (the bottleneck fix's before/after knob)."""
    # the wire
    latency_median_s: float = 0.06
    latency_p99_s: float = 0.35
    bandwidth_bps: float = 12.5e6
    """Per-connection transfer rate (100 Mbit/s)."""
    fault_rate: float = 0.02
    """Share of requests answered 503/429, reset before forwarding, or forwarded with the answer lost."""
    cap_rps: float = 300.0
    cap_burst: float = 150.0
    """Request-rate cap of the bucket (token bucket): above it, 429 SlowDown."""
    # a real fleet's sizes (bench/fleet/wire.py FleetSizes): the small model's objects stand for these
    anchor_bytes: int = 0
    """Declared bytes of an anchor, split over its shards (0 = the small model's own bytes, nothing sized)."""
    patch_bytes: int = 0
    """Declared bytes of every patch (0 = the small model's own)."""
    # processes and the storm
    worker_procs: int = 4
    storm: int = 0
    """Workers that join all at once at `storm_at_s` (a cold-join storm; 0 = none)."""
    storm_at_s: float = 60.0
    seed: int = 0
    label: str = ""

    @property
    def sized(self) -> bool:
        return bool(self.anchor_bytes or self.patch_bytes)

    @property
    def anchor_shards(self) -> int:
        """Shards of an anchor: as many as worker_contract/anchor.py's DEFAULT_SHARD_BYTES makes of a state of
        `anchor_bytes` (the small model's anchor is cut into as many)."""
        from worker_contract.anchor import DEFAULT_SHARD_BYTES

        return max(1, -(-self.anchor_bytes // DEFAULT_SHARD_BYTES))

    @property
    def batch(self) -> int:
        return self.groups_per_step or max(8, self.workers // 4)

    def kinds(self) -> list[str]:
        """The kind of every worker, in id order (deterministic shares, spread across ids)."""
        import random

        out = ["honest"] * self.workers
        ids = random.Random(self.seed).sample(range(self.workers), self.workers)  # spread across processes
        for kind in ("slow", "stale", "crashy", "hostile"):
            for _ in range(round(getattr(self, kind) * self.workers)):
                if ids:
                    out[ids.pop()] = kind
        return out

    def to_json(self) -> dict:
        return {**asdict(self), "anchor_shards": self.anchor_shards}

    def with_(self, **kw) -> FleetSpec:
        return replace(self, **kw)
