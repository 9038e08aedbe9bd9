"""The native engine's learner process on a GPU box: `python -m trainer.native --recipe-json R ...`.

The launch (infra/native_launch.py) starts this detached, after run.json and the base anchor exist; it
runs `trainer.learner.run_learner` (Ray on 127.0.0.1, the dashboard on 127.0.0.1 unless
DRL_RAY_DASHBOARD=0) until `train.num_steps` steps or SIGTERM/SIGINT, which stop it after the step in hand
with its publishes and a checkpoint (so `invoke stop` loses nothing). Its log is the run's log file:
one line per step, and `waiting for rollouts` while no batch has come yet.

    python -m trainer.native --recipe-json <state>/recipe.json --model-dir <hf dir> --state-dir <state>
                             [--env-file <remote_dir>/.r2env]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .config import RecipeConfig

log = logging.getLogger("trainer.native")

#: seconds between `waiting for rollouts` lines while the learner has no batch
WAITING_EVERY_S = 30.0


def _waiting_lines(last_step: list[float], stop: threading.Event) -> None:
    """Say `waiting for rollouts` while no step has come for a while (a thread's target)."""
    while not stop.wait(WAITING_EVERY_S):
        if time.monotonic() - last_step[0] >= WAITING_EVERY_S:
            log.info("waiting for rollouts: no batch of fresh groups yet (hand out the join card)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.native", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe-json", required=True, help="the resolved recipe (written by the launch)")
    ap.add_argument("--model-dir", required=True, help="the HF model directory (config, tokenizer, weights)")
    ap.add_argument("--state-dir", required=True, help="the run's state dir: trainer.key, checkpoints, metrics")
    ap.add_argument("--env-file", default=None, help="credentials file (mode 0600), e.g. <remote_dir>/.r2env")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    from worker_contract.env import load_env
    from worker_contract.manifest import load_manifest
    from worker_contract.signing import load_private_key
    from worker_contract.store import open_store

    from .learner import run_learner
    from .ray_runtime import ray_session

    cfg = RecipeConfig.model_validate_json(Path(args.recipe_json).read_text())
    env_file = Path(args.env_file) if args.env_file and Path(args.env_file).exists() else None
    env = dict(load_env(env_file=env_file))
    os.environ.setdefault("DRL_RAY_DASHBOARD", "1")  # on 127.0.0.1 only (trainer/ray_runtime.py)
    stop = threading.Event()
    store = open_store(cfg.store, env)
    key = load_private_key(Path(args.state_dir) / "trainer.key")
    last_step = [time.monotonic()]

    def on_step(m: dict) -> None:
        last_step[0] = time.monotonic()
        log.info("step %d v%s: reward %.3f, step %.2f s, publish blocking %.3f s, staleness %.2f",
                 m["step"], m.get("version"), m.get("rollout/raw_reward", float("nan")),
                 m.get("train/step_time_s", float("nan")), m.get("publish/blocking_s", float("nan")),
                 m.get("rollout/staleness_mean", float("nan")))

    threading.Thread(target=_waiting_lines, args=(last_step, stop), daemon=True).start()
    with ray_session(args.state_dir):  # run_learner joins this session
        # after Ray's start: its head installs a SIGTERM handler that ends every Ray process at once; ours
        # asks for a stop after the step in hand (publishes and a checkpoint), then Ray shuts down
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        res = run_learner(cfg, store, load_manifest(store, cfg.run), key, args.model_dir, args.state_dir,
                          on_step=on_step, stop_event=stop, store_env=env)
    print(json.dumps({"learner_done": {"step": res.step, "version": res.version,
                                       "first_version": res.first_version}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
