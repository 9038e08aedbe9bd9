"""The reference worker's loop: join the run, then sample, score and upload one batch of groups at a time.

    settings = WorkerSettings(store=..., run=..., model_dir=...)
    Worker(settings, env=os.environ).run(stop_event)

A batch is `batch_groups` groups (default 1) sampled together, their rows sharing each forward (what a
GPU worker needs to be more than launch overhead). Between batches (never inside one) it follows the
pointer, so every sample of a batch comes from one policy version, the version each record names. A stop
request (SIGTERM/SIGINT) lets the batch in hand finish and upload; an upload is one create-only put per
group, which a reader sees whole or not at all.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .. import layout
from ..env import parse_env
from ..manifest import ContractMismatch, RunManifest, load_manifest
from ..reconstruct import PointerRefused, SyncError
from ..schema import (
    ROUTED_SCHEMA_VERSION,
    SCHEMA_VERSION,
    RolloutRecord,
    Sample,
    SamplingParams,
    encode_record,
)
from ..signing import fingerprint
from ..store import NotFound, PreconditionFailed, Store, open_store
from ..tasks import TASKS, Problem, get_task, is_task

log = logging.getLogger("worker")

#: DRL_KV_MODE values each backend implements; None = the backend does not check the mode. For the MLX
#: worker, paged_prefix is one prompt prefill shared by the group's n samples (worker/mlx_sampling.py)
KV_MODES: dict[str, frozenset[str] | None] = {"torch": None, "mlx": frozenset({"paged_prefix"})}


class WorkerSettings(BaseModel):
    """What one worker process is told (command line and environment)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    store: str
    """Store URL (DRL_STORE): file:///abs/path, r2://<bucket> or s3://<bucket>."""
    run: str
    """Run id (DRL_RUN) to join."""
    model_dir: str | None = None
    """Local HF directory with the run's config.json and tokenizer; None = fetch them for run.json's model_id."""
    worker_id: str = Field(default_factory=lambda: f"{socket.gethostname().split('.')[0]}-{os.getpid()}")
    """Stable id of this worker (a key segment of every record it writes)."""
    max_groups: int = Field(0, ge=0)
    """Stop after this many uploaded groups (0 = run until stopped)."""
    seed: int | None = None
    """Seed for prompt choice and sampling (None = fresh randomness)."""
    threads: int | None = Field(None, ge=1)
    """torch CPU threads (None = torch's default; the torch backend only)."""
    backend: Literal["torch", "mlx"] = "torch"
    """The policy's framework: torch + transformers (the reference), or MLX + mlx-lm (Macs)."""
    mlx_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """MLX compute dtype (worker/mlx_model.py): auto = bfloat16 on a Metal GPU, float32 on a CPU."""
    batch_groups: int = Field(1, ge=1)
    """Groups sampled together in one batch (DRL_BATCH_GROUPS), all from one weights version: each forward
    takes batch_groups x n_samples rows. 1 = one group per forward (a CPU or a Mac); a GPU worker gains
    from more, as many as its memory holds (the KV cache grows with rows x (prompt + max_new_tokens))."""
    max_groups_per_version: int = Field(0, ge=0)
    """Pause after this many groups at one version until a newer one is published (0 = never pause): a
    worker sharing a machine with the learner should not burn CPU on groups that would only go stale."""
    idle_after_s: float = Field(900.0, ge=0)
    """When no newer version has come for this long and `idle_after_groups` groups of the one held are uploaded,
    the trainer has likely stopped: sample one batch every `idle_every_s` (from the end of the last) until a
    new version comes (0 = never slow down). A trickle, not a stop, so a learner still waiting for its batch
    gets it. Off for a worker that lags on purpose (`lag_versions`): its version can stand while the pointer
    moves."""
    idle_after_groups: int = Field(64, ge=1)
    idle_every_s: float = Field(300.0, gt=0)
    poll_interval_s: float = 2.0
    """How often to look for run.json / the first version while waiting, and the log cadence floor."""
    follow_interval_s: float = Field(0.5, gt=0)
    """How often the background follower reads the pointer while the worker samples (worker/follower.py): a
    version is applied beside sampling within about this long of its publish, so groups start less stale; on
    R2 it is one small GET each time."""
    wait_timeout_s: float = Field(600.0, gt=0)
    """Give up if the run publishes no weights within this long."""
    log_every_s: float = Field(10.0, gt=0)
    """Progress line cadence."""
    lag_versions: int = Field(0, ge=0)
    """Sample with the weights this many versions behind the pointer (0 = follow it): a worker that lags on
    purpose, so staleness experiments get groups exactly this many versions old."""
    retriever_url: str | None = None
    """The search service of a psqa run (DRL_RETRIEVER_URL, from the join card); unused by other tasks."""
    retriever_tier: Literal["auto", "light", "medium", "heavy"] = "auto"
    """Memory tier for retrieval (DRL_RETRIEVER_TIER): auto follows the machine's memory (worker/retrieval.py)."""
    retriever_timeout_s: float = Field(20.0, gt=0)
    """Whole-call limit of one retriever request; a failed one is retried twice, then the group is dropped."""
    max_turns: int = Field(4, ge=1)
    """Tool calls one psqa episode may make."""

    @field_validator("retriever_url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        from ..tasks.psqa_retrieval import check_url

        return None if v is None else check_url(v)


@dataclass
class WorkerStats:
    groups: int = 0
    samples: int = 0
    tokens: int = 0
    """Response tokens sampled."""
    sampling_s: float = 0.0
    """Seconds spent sampling (prefill and decode), for the status line's tokens per second."""
    versions_seen: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    """Groups sampled but not uploaded, by reason (retriever: the search tool failed after its retries)."""
    prefill_extend: int = 0
    """psqa: prefill tokens fed (each group's prompt once, then each sample's extension after a tool turn)."""
    prefill_reprefill: int = 0
    """psqa: prefill tokens a worker re-prefilling every turn's context from the start would have fed."""
    searches: int = 0
    """psqa: tool calls made."""
    swaps: list[dict] = field(default_factory=list)
    """Each version load: its seconds (the pause) and what it wrote (elements, bytes, tensors rewritten whole)."""
    forwards: int = 0
    """psqa: model forward passes (prefills, tool-turn extensions, batched decoding steps)."""
    search_s: float = 0.0
    """psqa: seconds spent waiting for the retriever (inside `sampling_s`), failed calls included."""
    follow_s: float = 0.0
    """Seconds between groups spent on new versions: the patches the background follower had not applied yet
    (worker/follower.py), then the model's rewrite of what changed."""


def declared_contract(env: Mapping[str, str]) -> tuple[int, str]:
    """(DRL_N_SAMPLES, DRL_PULSE_PLANE) this worker declares; the plane defaults to the quickstart's bf16."""
    c = parse_env(env)
    return c.n_samples, c.plane or "bf16"


def check_contract(manifest: RunManifest, n_samples: int, plane: str) -> None:
    """Fail closed, naming the value that differs, before any weights are fetched."""
    if manifest.plane != plane:
        raise ContractMismatch(f"DRL_PULSE_PLANE={plane!r} but run {manifest.run!r} publishes plane "
                               f"{manifest.plane!r}: set DRL_PULSE_PLANE={manifest.plane}")
    if manifest.n_samples != n_samples:
        raise ContractMismatch(f"DRL_N_SAMPLES={n_samples} but run {manifest.run!r} requires n_samples="
                               f"{manifest.n_samples}: set DRL_N_SAMPLES={manifest.n_samples} (every group of "
                               "another size is dropped)")


def check_kv_mode(manifest: RunManifest, declared: str | None, backend: str) -> None:
    """Fail closed on a KV-cache mode this backend does not implement, or one that differs from the run's."""
    supported = KV_MODES[backend]
    if declared is not None and manifest.kv_mode is not None and declared != manifest.kv_mode:
        raise ContractMismatch(f"DRL_KV_MODE={declared!r} but run {manifest.run!r} requires kv_mode="
                               f"{manifest.kv_mode!r}: set DRL_KV_MODE={manifest.kv_mode}")
    if supported is None:
        return
    for mode, whose in ((manifest.kv_mode, f"run {manifest.run!r} requires"), (declared, "DRL_KV_MODE asks for")):
        if mode is not None and mode not in supported:
            raise ContractMismatch(f"{whose} kv_mode={mode!r}; the {backend} worker implements "
                                   f"{', '.join(sorted(supported))} (one prompt prefill shared by the group)")


def check_trainer_key(manifest: RunManifest, expected: str) -> None:
    """Trust run.json's signing key only if it is the join card's (DRL_TRAINER_KEY_FINGERPRINT): anyone
    who can write to the bucket can replace run.json and sign weights with a key of their own."""
    got = fingerprint(manifest.trainer_public_key)
    if not expected:
        log.warning("DRL_TRAINER_KEY_FINGERPRINT is not set: trusting run.json's key %s as found; set it from "
                    "the join card so a replaced run.json is refused", got)
    elif got != expected:
        raise ContractMismatch(f"run {manifest.run!r} is signed by key {got}, but DRL_TRAINER_KEY_FINGERPRINT="
                               f"{expected!r} (the join card's): refusing weights signed by another key")
    else:
        log.info("run.json's signing key %s is the join card's (DRL_TRAINER_KEY_FINGERPRINT)", got)


def read_manifest(store: Store, run: str) -> RunManifest:
    """run.json, with a contract version this worker does not speak reported as a mismatch."""
    import json

    key = layout.manifest_key(run)
    raw = store.get(key)
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ValueError(f"{key} in {store.url} is not a valid run manifest (not a JSON object); the trainer "
                         "writes it once: check the store and the run id")
    version = data.get("contract_version")
    if version != layout.CONTRACT_VERSION:
        raise ContractMismatch(f"run {run!r} has contract_version={version!r}; this worker speaks "
                               f"contract_version={layout.CONTRACT_VERSION}: upgrade the worker")
    return load_manifest(store, run)


def resolve_model_dir(settings: WorkerSettings, manifest: RunManifest) -> Path:
    """--model if given, else config and tokenizer (no weights) of run.json's model_id from the HF Hub."""
    if settings.model_dir:
        return Path(settings.model_dir)
    from ..manifest import model_id_is_a_path

    if model_id_is_a_path(manifest.model_id):
        raise ContractMismatch(f"run {manifest.run!r} names its model by a directory on the trainer's machine "
                               f"({manifest.model_id}: an embedded run's own base, built there, on no hub): copy "
                               "that directory's config.json and tokenizer files here and pass --model DIR")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(manifest.model_id, allow_patterns=["*.json", "*.jinja", "*.txt", "*.model"]))
    except Exception as e:
        raise ContractMismatch(f"could not fetch config and tokenizer of {manifest.model_id!r} ({e}); "
                               "pass --model /path/to/hf-dir holding them") from None


class Worker:
    def __init__(self, settings: WorkerSettings, env: Mapping[str, str] | None = None):
        self.s = settings
        self.env = os.environ if env is None else env
        self.store = open_store(settings.store, self.env)
        layout.check_run_id(settings.run)
        layout.check_segment(settings.worker_id, "worker_id")
        self.n_samples, self.plane = declared_contract(self.env)
        self.stats = WorkerStats()
        self._per_version: dict[int, int] = {}
        self.version = 0  # the weights version held: 0 until the cold join
        self._version_at = time.monotonic()  # when the version held came (the idle trickle's clock)
        self._idle_batch_at: float | None = None  # None: not idle; else when the trickle's last batch ended
        self._rng = random.Random(settings.seed if settings.seed is not None else os.urandom(16))

    # -- setup ---------------------------------------------------------------------------------------
    def _wait_for(self, what: str, fetch, stop: threading.Event):
        deadline = time.monotonic() + self.s.wait_timeout_s
        said = False
        while True:
            try:
                return fetch()
            except NotFound:
                pass
            if not said:
                log.info("waiting for the trainer to publish %s of run %r in %s%s", what, self.s.run, self.store.url,
                         _empty_store_hint(self.store))
                said = True
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {self.s.run!r} published no {what} within {self.s.wait_timeout_s:.0f} s")
            if stop.wait(self.s.poll_interval_s):
                return None

    def setup(self, stop: threading.Event) -> bool:
        """Read and check run.json, load tokenizer and model, cold-join. False if stopped while waiting."""
        manifest = self._wait_for("run.json", lambda: read_manifest(self.store, self.s.run), stop)
        if manifest is None:
            return False
        self._check_run(manifest)
        self.task = get_task(manifest.task)
        self.search = None
        if "retriever" in self.task.services:  # refused before any weights are fetched (exit 2)
            from .retrieval import make_search

            self.search = self._timed(make_search(self.s.retriever_url, self.s.retriever_tier, manifest.run,
                                                  timeout_s=self.s.retriever_timeout_s))
        self.manifest = manifest
        self.task.dataset("train")  # its questions (a download, or a local split) before the weights: a Mac
        # without them is refused now, not after fetching gigabytes
        model_dir = resolve_model_dir(self.s, manifest)
        from .identity import check_identity

        check_identity(model_dir, manifest)
        self.policy = self._make_policy(model_dir, manifest)  # refused here, before any weights are fetched
        from ..reconstruct import Reconstructor

        self.rec = Reconstructor(self.store, self.s.run, plane=self.plane, n_samples=self.n_samples,
                                 public_key=manifest.trainer_public_key)  # the key checked above, kept

        joined = self._join_first(stop)
        if joined is None:
            return False
        self._swap(*joined)
        from .follower import Follower

        self.follower = Follower(self.rec, behind=self.s.lag_versions, interval_s=self.s.follow_interval_s,
                                 prepare=lambda state, changes: self.policy.prepare_patch(self.plane, state, changes))
        log.info("worker %s joined run %r at v%d (task %s, n_samples %d, plane %s, T=%g, max_new_tokens %d, "
                 "backend %s%s)", self.s.worker_id, self.s.run, self.version, manifest.task, self.n_samples,
                 self.plane, manifest.temperature, manifest.max_new_tokens, self._backend_name(),
                 f", {self.s.batch_groups} groups a batch" if self.s.batch_groups > 1 else "")
        return True

    def _check_run(self, manifest: RunManifest) -> None:
        """What this worker can check of run.json before anything is loaded: the contract, the KV mode, the
        trainer's key, the lag within the staleness bound, a task it knows."""
        check_contract(manifest, self.n_samples, self.plane)
        check_kv_mode(manifest, parse_env(self.env).kv_mode, self.s.backend)
        check_trainer_key(manifest, self.env.get("DRL_TRAINER_KEY_FINGERPRINT", "").strip())
        if self.s.lag_versions > manifest.staleness:
            raise ValueError(f"--lag-versions {self.s.lag_versions} is beyond run {manifest.run!r}'s staleness bound "
                             f"({manifest.staleness}): every group would be dropped as stale; give at most "
                             f"{manifest.staleness}")
        if not is_task(manifest.task):
            raise ContractMismatch(f"run {manifest.run!r} trains task {manifest.task!r}; this worker samples "
                                   f"{', '.join(sorted(TASKS))}")

    def _join_first(self, stop: threading.Event):
        """Cold-join at the newest anchor (waiting for the trainer's first weights); (version, state), or None
        if stopped while waiting. A pointer that does not verify is waited out, and said once."""
        refused: list[str] = []  # why the pointer did not verify, said once

        def join():
            try:
                return self.rec.join(self.s.lag_versions)
            except PointerRefused as e:  # a forged current.json: wait for the trainer's own (it reclaims it)
                if not refused:
                    log.warning("run %r: %s does not verify under the trainer's key (%s); not joining until the "
                                "trainer writes a valid pointer", self.s.run, layout.pointer_key(self.s.run), e)
                refused[:] = [str(e)]
                raise NotFound(str(e)) from None
            except SyncError as e:
                if "no weights yet" in str(e):
                    raise NotFound(str(e)) from None
                raise

        try:
            return self._wait_for("its first weights", join, stop)
        except TimeoutError:
            if not refused:
                raise
            raise TimeoutError(f"run {self.s.run!r} had no valid pointer within {self.s.wait_timeout_s:.0f} s: "
                               f"{layout.pointer_key(self.s.run)} does not verify under the trainer's key "
                               f"({refused[0]}); the trainer rewrites it when it starts or publishes") from None

    def _make_policy(self, model_dir: Path, manifest: RunManifest):
        seed = self._rng.getrandbits(63)
        if self.s.backend == "mlx":
            try:
                import mlx.core  # noqa: F401
                import mlx_lm  # noqa: F401

                from .mlx_model import MlxPolicy, rope_bases, rope_types
            except ImportError as e:
                raise ContractMismatch(f"the MLX worker needs mlx and mlx-lm ({e}): pip install "
                                       "'stoa-trainer[mlx]'") from None
            try:
                policy = MlxPolicy(model_dir, plane=self.plane, seed=seed, dtype=self.s.mlx_dtype)
            except ValueError as e:  # an architecture or RoPE variant the MLX worker does not run
                raise ContractMismatch(f"run {manifest.run!r}: {e}") from None
            bases = rope_bases(policy.model)
            if manifest.rope_theta is not None and bases != {float(manifest.rope_theta)}:
                raise ContractMismatch(f"the MLX model built from {model_dir} uses RoPE base(s) {sorted(bases)}, "
                                       f"run.json has rope_theta={manifest.rope_theta}")
            from .memory import check_memory, total_bytes, worker_memory

            need = worker_memory(policy.model, policy.config, plane=self.plane, dtype=policy.dtype,
                                 n_samples=self.n_samples, max_new_tokens=manifest.max_new_tokens,
                                 groups=self.s.batch_groups)
            check_memory(need, total_bytes(self.env), f"{manifest.model_id} on {self.plane} with {self.s.batch_groups} "
                         f"group(s) of {self.n_samples} and max_new_tokens {manifest.max_new_tokens}")
            want = {(manifest.rope_scaling or {}).get("rope_type", "default")}
            if rope_types(policy.model) != want:
                raise ContractMismatch(f"the MLX model built from {model_dir} uses RoPE {sorted(rope_types(policy.model))}, "
                                       f"run.json has rope_scaling={manifest.rope_scaling}")
            return policy
        try:
            from .model import PolicyModel
        except ImportError as e:  # a Mac installed with the mlx extra alone, and no --backend mlx
            raise ContractMismatch(f"the torch worker needs torch and transformers ({e}): on a Mac pass --backend "
                                   "mlx, or pip install 'stoa-trainer[worker]'") from None
        return PolicyModel(model_dir, threads=self.s.threads, seed=seed)

    def _backend_name(self) -> str:
        return f"mlx {self.policy.dtype}" if self.s.backend == "mlx" else "torch"

    def _swap(self, version: int, state, changes=None, prepared=None) -> None:
        """Load a version between groups (sync() runs before a group starts): after a patch only the elements
        it changed (`changes`, from the reconstructor; `prepared`: their values, read out by the follower's
        thread); after a join or an anchor every tensor."""
        t0 = time.monotonic()
        if prepared is not None:
            wrote = self.policy.write_patch(prepared)
        else:
            wrote = self.policy.load_plane(self.plane, state, changes)
        self.stats.swaps.append({"version": version, "seconds": round(time.monotonic() - t0, 4), **(wrote or {})})
        self._took(version)
        self.stats.versions_seen.append(version)

    def _took(self, version: int) -> None:
        """Hold `version` from now on; a newer one restarts the idle trickle's clock and ends the trickle."""
        if version != self.version:
            self._version_at = time.monotonic()
            if self._idle_batch_at is not None:
                self._idle_batch_at = None
                log.info("worker %s: v%d came; sampling at full speed again", self.s.worker_id, version)
        self.version = version

    # -- the loop ------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> WorkerStats:
        """Join, then loop until stopped (or `max_groups` groups are uploaded)."""
        if not self.setup(stop):
            return self.stats
        return self.loop(stop)

    def loop(self, stop: threading.Event) -> WorkerStats:
        self.follower.start()  # patches are read and applied while a group samples (worker/follower.py)
        try:
            return self._loop(stop)
        finally:
            self.follower.close()

    def _loop(self, stop: threading.Event) -> WorkerStats:
        train = self.task.dataset("train")
        last_log, key = time.monotonic(), None
        while not stop.is_set() and (self.s.max_groups <= 0 or self.stats.groups < self.s.max_groups):
            self.sync()  # between groups only: a group never mixes versions
            if self._ahead():
                self.sync(wait=True)  # nothing left to sample on this version: follow the pointer now
            if self._ahead() or self._idle():
                stop.wait(min(self.s.poll_interval_s, 0.5))
                continue
            problems = [train[self._rng.randrange(len(train))] for _ in range(self._batch_size())]
            for record in self.sample_groups(problems):  # one version: no sync until the next batch
                key = self.upload(record)
                self._per_version[record.policy_version] = self._per_version.get(record.policy_version, 0) + 1
                self.stats.groups += 1
                self.stats.samples += len(record.samples)
                self.stats.rewards.extend(s.reward for s in record.samples)
            if self._idle_batch_at is not None:  # the trickle's interval runs from the end of its batch
                self._idle_batch_at = time.monotonic()
            if time.monotonic() - last_log >= self.s.log_every_s and key is not None:
                last_log = time.monotonic()
                self._log_progress(key)
        st = self.stats
        searched = (f"; {st.searches} searches, {st.search_s:.1f} s waiting for the retriever of {st.sampling_s:.1f} s "
                    f"sampling" if self.search is not None else "")
        log.info("worker %s stopping: %d groups uploaded, last version v%d%s", self.s.worker_id, st.groups,
                 self.version, searched)
        return self.stats

    def sync(self, wait: bool = False) -> int:
        """Take the version the background follower reached (`lag_versions` behind the pointer; before the loop,
        or with `wait`, follow it now) and rewrite what changed; returns the version now held. Without `wait` it
        does not wait for a patch in flight (worker/follower.py). A forged or damaged object or a flaky store
        leaves the worker on the last version that verified."""
        t0 = time.monotonic()
        update = self.follower.take(wait)
        if update is not None:
            self._swap(*update)
        self.stats.follow_s += time.monotonic() - t0
        return self.version

    def _batch_size(self) -> int:
        """Groups in the next batch: `batch_groups`, less what `max_groups` or the per-version cap still allow."""
        n = self.s.batch_groups
        if self.s.max_groups > 0:
            n = min(n, self.s.max_groups - self.stats.groups)
        if self.s.max_groups_per_version > 0:
            n = min(n, self.s.max_groups_per_version - self._per_version.get(self.version, 0))
        return max(1, n)

    def _ahead(self) -> bool:
        cap = self.s.max_groups_per_version
        return cap > 0 and self._per_version.get(self.version, 0) >= cap

    def _idle(self) -> bool:
        """True while the idle trickle holds the next batch back (`idle_after_s`): no newer version for that
        long, enough groups of this one uploaded, and the trickle's last batch ended under `idle_every_s` ago."""
        now = time.monotonic()
        since = now - self._version_at
        if not self.s.idle_after_s or self.s.lag_versions or since < self.s.idle_after_s \
                or self._per_version.get(self.version, 0) < self.s.idle_after_groups:
            return False
        if self._idle_batch_at is None:  # entering the trickle: its first batch comes `idle_every_s` from now
            self._idle_batch_at = now
            log.info("worker %s: no version newer than v%d for %.0f s, and %d groups of it uploaded: the trainer "
                     "has likely stopped; sampling one batch every %.0f s until a new version comes (Ctrl-C "
                     "stops the worker)", self.s.worker_id, self.version, since,
                     self._per_version.get(self.version, 0), self.s.idle_every_s)
            return True
        return now - self._idle_batch_at < self.s.idle_every_s  # the loop restarts the clock when a batch ends

    def sample_group(self, problem: Problem) -> RolloutRecord:
        return self.sample_groups([problem])[0]

    def sample_groups(self, problems: list[Problem]) -> list[RolloutRecord]:
        """One group per problem, all sampled in one batch (a GPU worker's rows share each forward)."""
        m = self.manifest
        prompts = [self.policy.prompt_ids(self.task.messages(p)) for p in problems]
        if self.task.multi_turn:  # tool episodes (worker/episodes.py); the others: one sampled turn each
            return self._episode_groups(problems, prompts)
        t0 = time.monotonic()
        outs = self.policy.sample_many(prompts, self.n_samples, temperature=m.temperature, top_p=m.top_p,
                                       max_new_tokens=m.max_new_tokens)
        self.stats.sampling_s += time.monotonic() - t0
        self.stats.tokens += sum(len(o.token_ids) for group in outs for o in group)
        records = []
        for problem, prompt, group in zip(problems, prompts, outs, strict=True):
            samples = []
            for o in group:
                text = self.policy.decode(o.token_ids)
                samples.append(Sample(response_ids=o.token_ids, behavior_logprobs=o.logprobs,
                                      loss_mask=[1] * len(o.token_ids), reward=self.task.reward(text, problem),
                                      finish_reason=o.finish_reason))
            records.append(self._record(problem, prompt, samples, group))
        return records

    def _record(self, problem: Problem, prompt: list[int], samples: list[Sample], sampled: list) -> RolloutRecord:
        """The group's record; an MoE model's routes (the first sample's prompt routes: the group shares them
        in `paged_prefix`, and rows of one prompt route alike) make it a version-2 record."""
        m = self.manifest
        routes = None
        if sampled and getattr(sampled[0], "prompt_routes", None) is not None:
            from ..routes import encode_routes, routed_response_tokens

            routes = encode_routes(sampled[0].prompt_routes, [
                o.routes[:routed_response_tokens(s.loss_mask)] for o, s in zip(sampled, samples, strict=True)])
        return RolloutRecord(
            schema_version=SCHEMA_VERSION if routes is None else ROUTED_SCHEMA_VERSION, routes=routes,
            run=self.s.run, worker_id=self.s.worker_id, group_id=self._group_id(),
            policy_version=self.version, plane=self.plane, task=m.task, prompt_id=problem.id,
            prompt_ids=prompt, samples=samples, created_at=time.time(),
            sampling=SamplingParams(temperature=m.temperature, top_p=m.top_p, max_new_tokens=m.max_new_tokens))

    def _episode_groups(self, problems: list[Problem], prompts: list[list[int]]) -> list[RolloutRecord]:
        """psqa: n search episodes per problem, every group of the batch decoding together (worker/episodes.py);
        a batch whose search tool failed after its retries is dropped (each of its groups counted under
        `dropped['retriever']`), and the worker goes on."""
        from ..tasks.psqa_retrieval import RetrieverError

        m = self.manifest
        t0 = time.monotonic()
        try:
            groups, count = self.policy.sample_episode_groups(prompts, self.n_samples, temperature=m.temperature,
                                                              top_p=m.top_p, max_new_tokens=m.max_new_tokens,
                                                              search=self.search, max_turns=self.s.max_turns)
        except RetrieverError as e:
            self.stats.dropped["retriever"] = self.stats.dropped.get("retriever", 0) + len(problems)
            log.warning("%d group(s) of %s dropped (%d so far): the retriever failed: %s", len(problems),
                        ", ".join(p.id for p in problems), self.stats.dropped["retriever"], str(e)[:200])
            return []
        finally:
            self.stats.sampling_s += time.monotonic() - t0
        self.stats.tokens += sum(sum(e.loss_mask) for eps in groups for e in eps)
        self.stats.prefill_extend += count.extend
        self.stats.prefill_reprefill += count.reprefill
        self.stats.forwards += count.forwards
        self.stats.searches += sum(len(e.searches) for eps in groups for e in eps)
        return [self._record(problem, prompt, [e.to_sample(self.task.reward(e.text, problem)) for e in eps], eps)
                for problem, prompt, eps in zip(problems, prompts, groups, strict=True)]

    def _timed(self, search):
        """`search`, adding the seconds each call waits (answered or failed) to stats.search_s."""
        def timed(query: str) -> str:
            t0 = time.monotonic()
            try:
                return search(query)
            finally:
                self.stats.search_s += time.monotonic() - t0
        return timed

    def _group_id(self) -> str:
        return f"g{time.time_ns() // 1_000_000:013d}-{self._rng.getrandbits(32):08x}"

    def upload(self, record: RolloutRecord) -> str:
        """One create-only put; a (vanishingly unlikely) id collision retries under a fresh id."""
        for _ in range(3):
            key = layout.rollout_key(self.s.run, record.policy_version, self.s.worker_id, record.group_id)
            try:
                self.store.put_if_absent(key, encode_record(record))
                return key
            except PreconditionFailed:
                record = record.model_copy(update={"group_id": self._group_id()})
        raise RuntimeError("three group-id collisions in a row: is another worker using the same --worker-id?")

    def _log_progress(self, key: str) -> None:
        recent = self.stats.rewards[-10 * self.n_samples:]
        st = self.stats
        extra = (f", {st.searches} searches ({st.search_s:.1f} s waiting for the retriever, "
                 f"{100 * st.search_s / max(st.sampling_s, 1e-9):.0f}% of sampling), "
                 f"{st.forwards / max(st.tokens, 1):.2f} forwards a sampled token, prefill {st.prefill_extend} "
                 f"tokens (re-prefill would be {st.prefill_reprefill}), dropped {st.dropped or 0}"
                 if self.search is not None else "")
        log.info("worker %s: v%d, %d groups, mean reward %.3f over the last %d samples, %.1f tokens/s, %.1f s "
                 "sampling and %.1f s following versions so far%s; last %s", self.s.worker_id, self.version, st.groups,
                 sum(recent) / max(1, len(recent)), len(recent), st.tokens / max(st.sampling_s, 1e-9), st.sampling_s,
                 st.follow_s, extra, key)


def _empty_store_hint(store) -> str:
    """For a file store that holds nothing at all (opening one creates its directory: a typo in --store makes
    an empty one), say so beside the wait."""
    from ..store.file import FileStore

    if isinstance(store, FileStore) and not any(store.root.iterdir()):
        return " (it is empty: if the trainer already runs, check --store / DRL_STORE)"
    return ""
