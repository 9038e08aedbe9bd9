"""Entry point the resume tests run as a real subprocess (and kill with SIGKILL).

    python tests/learner_proc.py save-loop <ckpt_root> <model_dir>
        one optimizer step, then checkpoints forever; prints "SAVED <step>" after each
    python tests/learner_proc.py learn <store_root> <run_dir> <model_dir> <key_path> <run> <num_steps> <staleness>
        the real learner loop (Ray actors, publisher) on a file store; prints "STEP <json>" per step
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def save_loop(ckpt_root: str, model_dir: str) -> None:
    import torch
    from learner_fixtures import make_record, recipe

    from trainer import checkpoint
    from trainer.backends import get_backend
    from trainer.objectives import policy_loss
    from trainer.step import collate

    torch.set_num_threads(1)
    cfg = recipe()
    backend = get_backend("hf").load(model_dir, cfg, device="cpu")
    batch = collate([make_record("r", 1, "w", "g", random.Random(0))])
    batch.ref_logp = backend.logprobs(batch, reference=True)
    backend.train_step(batch, lambda lp, mb: policy_loss(lp, mb.behavior_logp, mb.ref_logp, mb.advantages,
                                                         mb.loss_mask, cfg.algo))
    step = 0
    while True:
        step += 1
        state = checkpoint.TrainerState(step=step, ledger={"version": 1, "reuse_cap": 2, "uses": {"k": step}},
                                        last_published_version=step)
        checkpoint.save(ckpt_root, state, backend, keep=2)
        print(f"SAVED {step}", flush=True)


def learn(store_root: str, run_dir: str, model_dir: str, key_path: str, run: str, num_steps: str,
          staleness: str) -> None:
    from learner_fixtures import manifest, recipe

    from trainer.native.learner import run_learner
    from worker_contract.manifest import create_or_resume
    from worker_contract.signing import load_private_key
    from worker_contract.store.file import FileStore

    store = FileStore(store_root)
    key = load_private_key(key_path)
    m = create_or_resume(store, manifest(run, key, staleness=int(staleness)), resume=True)
    cfg = recipe(staleness=int(staleness), num_steps=int(num_steps))

    def on_step(metrics: dict) -> None:
        print("STEP " + json.dumps({"step": metrics["step"], "version": metrics["version"]}), flush=True)

    result = run_learner(cfg, store, m, key, model_dir, run_dir, on_step=on_step, batch_wait_s=1.0,
                         torch_threads=1)
    print("DONE " + json.dumps({"step": result.step, "version": result.version,
                                "first_version": result.first_version, "resumed_from": result.resumed_from}),
          flush=True)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    {"save-loop": save_loop, "learn": learn}[mode](*args)
