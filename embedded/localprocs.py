"""The embedded run's child processes: started in sessions of their own, stopped by PID.

Each child gets its own session, so a terminal's Ctrl-C reaches only the launcher, which then stops the
children in order (SIGTERM: the learner finishes its step and checkpoints, workers finish their group;
SIGKILL after a timeout). On Linux a child also gets SIGTERM if the launcher dies (PR_SET_PDEATHSIG).

Each child is recorded in the run dir, `children/<name>.json` (PID and start time), until the launcher has
stopped it: a launcher that died without stopping them (SIGKILL; macOS has no PDEATHSIG) leaves records,
a relaunch of the run is refused while one still runs, and `invoke stop|teardown --local` stops them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra.children import CHILDREN_DIR, process_start_time
from trainer.config import REPO_ROOT

from .config import EmbeddedRecipe


def _die_with_parent() -> None:
    """Child setup: a session of its own (Ctrl-C reaches only the launcher), SIGTERM if the launcher dies."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own stop path still applies
        pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Processes:
    """The processes this run started, stopped by PID (their own process groups). With `record` (the run
    dir) each child is written to `record/children/<name>.json` until `stop` has ended it."""

    children: list[Child] = field(default_factory=list)
    record: Path | None = None

    def start(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> Child:
        with open(log, "ab") as f:
            proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        child = Child(name, proc, log)
        self.children.append(child)
        if self.record is not None:
            rec = self.record / CHILDREN_DIR / f"{name}.json"
            rec.parent.mkdir(exist_ok=True)
            tmp = rec.with_suffix(".tmp")
            tmp.write_text(json.dumps({"name": name, "pid": proc.pid, "started": process_start_time(proc.pid),
                                       "argv": argv[:4]}) + "\n")
            tmp.replace(rec)
        return child

    @staticmethod
    def signal(child: Child, sig: int) -> None:
        """SIGKILL: the process group we created for a child, it and what it started (Ray's processes), also
        when the child itself is gone. Any other signal: the child alone, which stops what it started
        itself (a SIGTERM to the group would reach Ray's processes too, and they end on it mid-step)."""
        try:
            if sig == signal.SIGKILL:
                os.killpg(child.proc.pid, sig)
            elif child.alive():
                os.kill(child.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def signal_all(self, sig: int) -> None:
        for c in self.children:
            self.signal(c, sig)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM every child (graceful: the learner checkpoints, workers finish their group), then SIGKILL."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.signal_all(signal.SIGKILL)
        for c in self.children:
            c.proc.wait()
            if self.record is not None:
                (self.record / CHILDREN_DIR / f"{c.name}.json").unlink(missing_ok=True)


def child_env(cfg: EmbeddedRecipe) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p),
               DRL_N_SAMPLES=str(cfg.contract.n_samples), DRL_PULSE_PLANE=cfg.contract.plane,
               DRL_TORCH_THREADS="1", OMP_NUM_THREADS="1", DRL_PROGRESS="0", PYTHONUNBUFFERED="1")
    return env


def start_learner(procs: Processes, cfg: EmbeddedRecipe, paths, model_dir: Path,
                  extra_env: dict[str, str] | None = None) -> Child:
    recipe = paths.run_dir / "recipe.json"
    recipe.write_text(cfg.model_dump_json(indent=2))
    from infra.native_launch import learner_argv

    argv = learner_argv(sys.executable, recipe, model_dir, paths.run_dir)
    return procs.start("learner", argv, {**child_env(cfg), **(extra_env or {})}, paths.run_dir / "learner.log")


def worker_backends(cfg: EmbeddedRecipe) -> list[str]:
    """The local workers' backends, one per worker: `embedded.worker_backends`, else `workers` x `worker_backend`."""
    e = cfg.embedded
    return list(e.worker_backends) or [e.worker_backend] * e.workers


def per_worker_cap(cfg: EmbeddedRecipe) -> int:
    """Groups a local worker samples per version: together the workers make one step's batch per version,
    so on a shared CPU they do not burn cycles on groups that would go stale before the learner uses them."""
    return max(1, -(-cfg.algo.groups_per_step // len(worker_backends(cfg))))


def worker_env(cfg: EmbeddedRecipe, trainer_key_fingerprint: str) -> dict[str, str]:
    """A local worker's environment: the join card's key fingerprint too, so the worker accepts run.json
    (and the pointer and patches it signs) only under the key this launcher holds, as a remote joiner does.

    No GPU (CUDA_VISIBLE_DEVICES empty): a worker on CUDA samples in bf16, and the small embedded model in
    bf16 is another model (log-probs 0.0045 nats per token from the learner's, held-out score 3.5 points
    lower, measured on an H200); on the CPU it samples in float32, as on a machine without a GPU."""
    return {**child_env(cfg), "DRL_TRAINER_KEY_FINGERPRINT": trainer_key_fingerprint, "CUDA_VISIBLE_DEVICES": ""}


def worker_argv(cfg: EmbeddedRecipe, model_dir: Path | str, i: int, backend: str,
                extra_args: list[str] | None = None) -> list[str]:
    """The command line of local worker `i` (1-based), as started and as the dry run prints it."""
    return [sys.executable, "-m", "worker_contract.worker", "--store", cfg.store, "--run", cfg.run,
            "--model", str(model_dir), "--worker-id", f"local-{i}", "--threads", "1", "--log-every", "30",
            "--max-groups-per-version", str(per_worker_cap(cfg)), "--backend", backend, *(extra_args or [])]


def start_workers(procs: Processes, cfg: EmbeddedRecipe, paths, model_dir: Path, trainer_key_fingerprint: str,
                  extra_args: list[str] | None = None, extra_env: dict[str, str] | None = None) -> list[Child]:
    out = []
    for i, backend in enumerate(worker_backends(cfg), start=1):
        env = {**worker_env(cfg, trainer_key_fingerprint), **(extra_env or {})}
        out.append(procs.start(f"worker-{i}", worker_argv(cfg, model_dir, i, backend, extra_args), env,
                               paths.run_dir / f"worker-{i}.log"))
    return out
