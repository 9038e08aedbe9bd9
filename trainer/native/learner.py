"""The native engine's loop: the learner session (trainer/session.py) in two Ray actors, one code path.

    run_learner(cfg, store, manifest, key, model_dir, run_dir, on_step=..., stop_event=...)
    serve(cfg, model_dir, state_dir, env_file)   the learner process's body (python -m entrypoints.learner)

The source actor holds the rollout side, the learner actor the backend and the train side. Setup resumes
from the newest checkpoint and publishes a fresh anchor at a new, higher version; each step (trainer/step.py)
trains on a batch and hands the new weights to the publisher thread; metrics, stats and checkpoints follow.
Importing this module starts nothing (Ray, torch and transformers are imported where used).
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker_contract.manifest import RunManifest
from worker_contract.store import Store

from ..config import RecipeConfig

if TYPE_CHECKING:
    from ..rollouts.pool import Batch
    from ..step import BatchNote

log = logging.getLogger(__name__)

StepCallback = Callable[[dict[str, Any]], None]


@dataclass
class LearnerResult:
    step: int
    """Optimizer steps taken in total (including those before a resume)."""
    version: int
    """The newest version the publisher made visible."""
    first_version: int
    """The anchor this session published at start."""
    resumed_from: str | None
    """The checkpoint this session resumed from, if any."""
    metrics_path: Path
    """The run's metrics.jsonl."""
    stopped_by: int | None = None
    """The signal that stopped this session after its step in hand (SIGTERM, SIGINT); None: it ran its steps."""


class SourceActor:
    """The rollout side (trainer/session.py) in its own actor, polling in a background thread so batches
    are ready when asked for."""

    def __init__(self, spec, manifest_json: str, algo_json: str, poll_interval_s: float, model_dir: str | None = None):
        from ..config import AlgoConfig
        from ..ray_runtime import open_store_spec
        from ..session import RolloutSide

        self.side = RolloutSide(open_store_spec(spec), RunManifest.model_validate_json(manifest_json),
                                AlgoConfig.model_validate_json(algo_json), poll_interval_s, model_dir=model_dir)
        self._stop = threading.Event()
        threading.Thread(target=self.side.source.run_poller, args=(self._stop, poll_interval_s), daemon=True).start()

    def next_batch(self, current: int, timeout_s: float):
        return self.side.next_batch(current, timeout_s, stop_event=self._stop)

    def counts(self):
        return self.side.counts()

    def ledger_state(self) -> dict:
        return self.side.ledger_state()

    def load_ledger_state(self, state: dict) -> None:
        self.side.load_ledger_state(state)

    def stop(self) -> None:
        self._stop.set()


class LearnerActor:
    """The policy and its backend driving the learner session (trainer/session.py); the source is another actor."""

    def __init__(self, cfg_json: str, model_dir: str, run_dir: str, source, spec, manifest_json: str,
                 key_pem: bytes, torch_threads: int | None, device: str | None = None):
        import torch

        from ..backends import get_backend
        from ..ray_runtime import key_from_pem, open_store_spec
        from ..session import LearnerSession

        cfg = RecipeConfig.model_validate_json(cfg_json)
        if torch_threads:
            torch.set_num_threads(torch_threads)
        torch.manual_seed(cfg.train.seed)
        # `device` "cuda" with tensor parallel > 1: the backend's rank actors hold one GPU each, this actor none
        self.backend = get_backend(cfg.train.backend).load(model_dir, cfg, **({"device": device} if device else {}))
        self.source = source
        self.session = LearnerSession(cfg, open_store_spec(spec), RunManifest.model_validate_json(manifest_json),
                                      key_from_pem(key_pem), run_dir=run_dir)
        self._waited = 0.0  # time the steps since the last one waited for a batch (learner/wait_s)
        self._ckpt_blocking = 0.0  # time checkpoint saves blocked the loop since the last step's row

    # -- start -------------------------------------------------------------------------------------
    def setup(self) -> dict:
        import ray

        s = self.session
        found = s.resume(self.backend)
        if found.state is not None:
            ray.get(self.source.load_ledger_state.remote(found.state.ledger))
        version = s.publish_start(self.backend.publish_snapshot(), ray.get(self.source.counts.remote()),
                                  found.state.last_published_version if found.state is not None else None)
        return {"step": s.step, "version": version, "resumed_from": str(found.path) if found.path else None,
                "skipped_checkpoints": found.skipped}

    # -- the step ----------------------------------------------------------------------------------
    def train_one(self, timeout_s: float) -> dict | None:
        """One optimizer step, or None if no batch could be assembled within `timeout_s`."""
        import ray

        s = self.session
        s.take_published()
        t_wait = time.monotonic()
        got = ray.get(self.source.next_batch.remote(s.current, timeout_s))
        self._waited += time.monotonic() - t_wait  # learner/wait_s: the loop's busy share (bench/gpu_loop.py)
        return None if got is None else self.train_batch(*got)

    def train_batch(self, batch: Batch, note: BatchNote) -> dict:
        """The step on a batch the source handed out: train, snapshot the new weights, hand them to the
        publisher with the step's report; returns the step's row."""
        from ..step import publish_metrics, step_metrics, train_on

        s = self.session
        t0 = time.monotonic()
        train = train_on(self.backend, [g.record for g in batch.groups], s.cfg.algo, s.audit, s.weights_version())
        s.step += 1
        step_time = time.monotonic() - t0
        t_pub = time.monotonic()
        state = self.backend.publish_snapshot()  # the step's own copy: training may go on at once
        snapshot_s = time.monotonic() - t_pub
        metrics = step_metrics(note, s.audit, train)
        metrics["train/step_time_s"] = step_time
        metrics.update(step=s.step, version=s.current, batch_version=note.current_version)
        metrics["learner/wait_s"], self._waited = self._waited, 0.0  # waited for this step's batch
        metrics.update(self._checkpoint_metrics())
        blocking = snapshot_s + s.hand_off(state, s.report(note, metrics))  # a copy of metrics: the thread reads it
        metrics.update(publish_metrics(s.publishing, blocking))
        # which groups this step used (and how often): lets an audit rebuild the lineage's consumption
        return {**metrics, "rollout/groups": [[g.key, g.use] for g in batch.groups]}

    # -- checkpoints and end -----------------------------------------------------------------------
    def save(self) -> float:
        """Begin the step's checkpoint, written in the background; returns the seconds the loop was blocked."""
        import ray

        self._ckpt_blocking += self.session.save_in_background(self.backend, ray.get(self.source.ledger_state.remote()))
        return self._ckpt_blocking

    def _checkpoint_metrics(self) -> dict:
        """What checkpoints cost since the last step's row: the save call's block, the optimizer update's wait
        for a write still reading the state, and the newest complete checkpoint's figures."""
        saver = self.session.saver
        if saver is None:
            return {}
        out = {"checkpoint/blocking_s": round(self._ckpt_blocking, 4),
               "checkpoint/update_wait_s": round(saver.gate.waited_s, 4), **saver.last}
        self._ckpt_blocking, saver.gate.waited_s = 0.0, 0.0
        return out

    def finish(self) -> dict:
        """Wait for every publish and checkpoint, checkpoint the last step, report where the run stands."""
        import ray

        s = self.session
        s.close()
        s.wait_saves()
        if s.saved_step != s.step:
            s.save(self.backend, ray.get(self.source.ledger_state.remote()))
        return {"step": s.step, "version": s.current}


def run_learner(
    cfg: RecipeConfig,
    store: Store,
    manifest: RunManifest,
    key,
    model_dir: str | Path,
    run_dir: str | Path,
    on_step: StepCallback | None = None,
    stop_event: threading.Event | None = None,
    *,
    store_env: dict[str, str] | None = None,
    ray_address: str | None = None,
    batch_wait_s: float = 5.0,
    torch_threads: int | None = None,
) -> LearnerResult:
    """Train until `cfg.train.num_steps` steps in total (or `stop_event`); see the module docstring.

    `key` is the run's Ed25519 private key (it signs what the publisher writes); `run_dir` is the run's
    local directory (checkpoints, metrics.jsonl, Ray's temp dir). `on_step(metrics)` runs in this
    process after every step. `torch_threads` caps the learner's CPU threads (default: DRL_TORCH_THREADS,
    else torch's own choice).
    """
    from ..metrics import MetricsLogger
    from ..ray_runtime import ray_session

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _check_contract(cfg, manifest)
    threads = torch_threads or int(os.environ.get("DRL_TORCH_THREADS", "0") or 0) or None
    stop_event = stop_event or threading.Event()
    with ray_session(run_dir, address=ray_address):
        import ray  # after the session set Ray's environment up

        source, learner = _start_actors(cfg, store, store_env, manifest, key, model_dir, run_dir, threads)
        info = _setup(learner)
        logger = MetricsLogger(run_dir, manifest.run, config=cfg.model_dump(mode="json"))
        try:
            _drive(cfg, learner, info["step"], logger, on_step, stop_event, batch_wait_s)
            final = ray.get(learner.finish.remote())
            ray.get(source.stop.remote())
        finally:
            logger.close()
    return LearnerResult(step=final["step"], version=final["version"], first_version=info["version"],
                         resumed_from=info["resumed_from"], metrics_path=logger.path)


def _check_contract(cfg: RecipeConfig, manifest: RunManifest) -> None:
    """A run keeps its contract: the recipe must resolve run.json's group size and plane."""
    if manifest.n_samples != cfg.contract.n_samples or manifest.plane != cfg.contract.plane:
        raise ValueError(f"run.json has n_samples={manifest.n_samples}, plane={manifest.plane!r} but the recipe "
                         f"resolves contract.n_samples={cfg.contract.n_samples}, contract.plane="
                         f"{cfg.contract.plane!r}; resume with the run's contract (DRL_N_SAMPLES / DRL_PULSE_PLANE)")


def _start_actors(cfg: RecipeConfig, store: Store, store_env: dict[str, str] | None, manifest: RunManifest, key,
                  model_dir: str | Path, run_dir: Path, threads: int | None):
    """The source actor and the learner actor (in the Ray session); the learner holds the GPU, unless
    tensor-parallel rank actors take the GPUs, one each."""
    import ray

    from ..ray_runtime import key_to_pem, store_spec

    spec = store_spec(store, store_env)
    mjson = manifest.model_dump_json()
    source = ray.remote(num_cpus=0)(SourceActor).remote(
        spec, mjson, cfg.algo.model_dump_json(), cfg.train.poll_interval_s, str(model_dir))
    on_gpus = ray.cluster_resources().get("GPU", 0) >= 1
    tp_ranks = on_gpus and cfg.compute.tensor_parallel > 1
    gpus = 1 if on_gpus and not tp_ranks else 0
    learner = ray.remote(num_cpus=0, num_gpus=gpus)(LearnerActor).remote(
        cfg.model_dump_json(), str(model_dir), str(run_dir), source, spec, mjson, key_to_pem(key), threads,
        "cuda" if tp_ranks else None)
    return source, learner


def _setup(learner) -> dict:
    """The learner actor's setup (resume, the first anchor), logged; a checkpoint that does not load is
    raised as its own one-sentence error, not as Ray's traceback."""
    import ray

    try:
        info = ray.get(learner.setup.remote())
    except ray.exceptions.RayTaskError as e:
        from ..checkpoint import CheckpointError

        if isinstance(e.cause, CheckpointError):
            raise CheckpointError(str(e.cause)) from None
        raise
    for line in info.get("skipped_checkpoints", []):
        log.warning("%s", line)
    log.info("learner at step %d, published anchor v%d%s", info["step"], info["version"],
             f" (resumed from {info['resumed_from']})" if info["resumed_from"] else "")
    return info


def _drive(cfg: RecipeConfig, learner, step: int, logger, on_step: StepCallback | None,
           stop_event: threading.Event, batch_wait_s: float) -> None:
    """Steps from `step` until `cfg.train.num_steps` or the stop event: each row logged (before the
    checkpoint: every checkpointed step is in the log), handed to `on_step`, a checkpoint every interval."""
    import ray

    while step < cfg.train.num_steps and not stop_event.is_set():
        metrics = ray.get(learner.train_one.remote(batch_wait_s))
        if metrics is None:
            continue
        step = metrics["step"]
        logger.log(step, metrics)
        if on_step is not None:
            on_step(metrics)
        if step % cfg.checkpoint.interval == 0:
            ray.get(learner.save.remote())


# -- the learner process ---------------------------------------------------------------------------------
#: seconds between `waiting for rollouts` lines while the learner has no batch
WAITING_EVERY_S = 30.0


def _waiting_lines(last_step: list[float], stop: threading.Event) -> None:
    """Say `waiting for rollouts` while no step has come for a while (a thread's target)."""
    while not stop.wait(WAITING_EVERY_S):
        if time.monotonic() - last_step[0] >= WAITING_EVERY_S:
            log.info("waiting for rollouts: no batch of fresh groups yet (workers join with the run's join card)")


def serve(cfg: RecipeConfig, model_dir: str | Path, state_dir: str | Path,
          env_file: str | Path | None = None) -> LearnerResult:
    """The learner process's work, whichever launcher started it: `run_learner` in a Ray session on
    127.0.0.1 until `cfg.train.num_steps` steps or SIGTERM/SIGINT, which stop it after the step in hand
    (its publishes and a checkpoint, so `invoke stop` loses nothing). One log line per step, and `waiting
    for rollouts` every WAITING_EVERY_S s while no batch comes. The store's credentials: `env_file` when it
    exists, else `.r2env` in the working directory when there, the environment winning; the run's key:
    `<state_dir>/trainer.key`. Call it from the main thread (it installs the signal handlers)."""
    import signal

    from worker_contract.env import load_env
    from worker_contract.manifest import load_manifest
    from worker_contract.signing import load_private_key
    from worker_contract.store import open_store

    from ..ray_runtime import ray_session

    env = load_env(env_file=env_file if env_file is not None and Path(env_file).exists() else None)
    store = open_store(cfg.store, env)
    key = load_private_key(Path(state_dir) / "trainer.key")
    stop = threading.Event()
    last_step = [time.monotonic()]

    def on_step(m: dict) -> None:
        last_step[0] = time.monotonic()
        log.info("step %d v%s: reward %.3f, step %.2f s, publish blocking %.3f s, staleness %.2f",
                 m["step"], m.get("version"), m.get("rollout/raw_reward", float("nan")),
                 m.get("train/step_time_s", float("nan")), m.get("publish/blocking_s", float("nan")),
                 m.get("rollout/staleness_mean", float("nan")))

    threading.Thread(target=_waiting_lines, args=(last_step, stop), daemon=True).start()
    with ray_session(state_dir):  # run_learner joins this session
        # after Ray's start: its head installs a SIGTERM handler that ends every Ray process at once (no last
        # step, no checkpoint); ours asks for a stop after the step in hand, then Ray shuts down
        stopped_by: list[int] = []

        def on_signal(signum, _frame) -> None:
            stopped_by.append(signum)
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        res = run_learner(cfg, store, load_manifest(store, cfg.run), key, model_dir, state_dir,
                          on_step=on_step, stop_event=stop, store_env=env)
        return dataclasses.replace(res, stopped_by=stopped_by[0] if stopped_by else None)
