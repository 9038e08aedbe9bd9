"""Entry point of the reference worker; see worker_contract/worker/__init__.py."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from ..cli import number

#: more CPU threads than this is no machine's (torch crashed at 99999)
MAX_THREADS = max(64, 4 * (os.cpu_count() or 1))


def default_store(env) -> str | None:
    """DRL_STORE, else the R2 bucket of an R2 join card (which names R2_BUCKET, not DRL_STORE)."""
    if env.get("DRL_STORE", "").strip():
        return env["DRL_STORE"].strip()
    bucket = env.get("R2_BUCKET", "").strip()
    return f"r2://{bucket}" if bucket else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m worker_contract.worker",
        description="Reference rollout worker: joins a run through the bucket, samples groups, uploads records. "
                    "The group size and weight plane come from DRL_N_SAMPLES (default 8) and DRL_PULSE_PLANE "
                    "(default bf16) and must match the run's run.json.",
    )
    p.add_argument("--store", default=default_store(os.environ),
                   help="store URL: file:///abs/path, r2://bucket, s3://bucket (default: $DRL_STORE, else "
                        "r2://$R2_BUCKET when R2_BUCKET is set, as an R2 join card sets it)")
    p.add_argument("--run", default=os.environ.get("DRL_RUN"), help="run id to join (default: $DRL_RUN)")
    p.add_argument("--model", default=os.environ.get("DRL_MODEL"),
                   help="local HF dir with the run's config.json and tokenizer (default: fetch them for "
                        "run.json's model_id)")
    p.add_argument("--worker-id", default=os.environ.get("DRL_WORKER_ID"), help="stable worker id (default host-pid)")
    p.add_argument("--groups", type=number(int, at_least=1, hint="leave --groups out to run until stopped"), default=0,
                   help="stop after this many groups (default: run until stopped)")
    p.add_argument("--max-groups-per-version", type=number(int, at_least=0, hint="0: never pause"), default=None,
                   help="pause after this many groups at one version until a newer one is published")
    p.add_argument("--idle-after", type=number(float, at_least=0, hint="0: never slow down"), default=None,
                   help="seconds without a new version (and 64 groups of the one held uploaded) after which the "
                        "trainer is taken as stopped: one batch every 5 minutes until a new version (default 900)")
    p.add_argument("--batch-groups", type=number(int), default=os.environ.get("DRL_BATCH_GROUPS") or None,
                   help="groups sampled together, their rows sharing each forward, all from one weights version "
                        "(default: $DRL_BATCH_GROUPS, else 1); a GPU worker needs more than one to be fast")
    p.add_argument("--seed", type=number(int, at_least=0), default=None, help="seed for prompts and sampling")
    p.add_argument("--lag-versions", type=number(int, at_least=0), default=None,
                   help="sample with the weights this many versions behind the pointer (staleness experiments)")
    p.add_argument("--threads", type=number(int, at_least=1, at_most=MAX_THREADS), default=None, help="torch CPU threads")
    p.add_argument("--backend", choices=("torch", "mlx"), default=os.environ.get("DRL_WORKER_BACKEND") or "torch",
                   help="torch + transformers (the reference), or mlx + mlx-lm (Apple silicon; Linux through "
                        "mlx[cpu]) (default: $DRL_WORKER_BACKEND, else torch)")
    p.add_argument("--mlx-dtype", choices=("auto", "float32", "bfloat16"), default=None,
                   help="MLX compute dtype (default auto: bfloat16 on a Mac's GPU, float32 on a CPU)")
    p.add_argument("--retriever-url", default=os.environ.get("DRL_RETRIEVER_URL") or None,
                   help="psqa runs: the search service from the join card (default: $DRL_RETRIEVER_URL)")
    p.add_argument("--retriever-tier", default=os.environ.get("DRL_RETRIEVER_TIER") or None,
                   help="psqa runs: memory tier auto, light (15-23 GB: shared retriever only), medium or heavy "
                        "(may use a local index on 127.0.0.1) (default: $DRL_RETRIEVER_TIER, else auto: by "
                        "this machine's memory)")
    p.add_argument("--max-turns", type=number(int, at_least=1), default=None,
                   help="psqa runs: tool calls one search episode may make (default 4)")
    p.add_argument("--wait", type=number(float, above=0), default=600.0, help="seconds to wait for the run's first weights")
    p.add_argument("--log-every", type=number(float, above=0), default=10.0, help="seconds between progress lines")
    args = p.parse_args(argv)
    if not args.store or not args.run:
        p.error("--store and --run are required (or set DRL_STORE and DRL_RUN)")
    if args.retriever_tier is not None:  # the environment's value is no argparse choice: checked here, as typed
        from .retrieval import TIERS

        typed, args.retriever_tier = args.retriever_tier, args.retriever_tier.strip().lower()
        if args.retriever_tier not in TIERS:  # named as given: the flag (or an abbreviation of it), else the variable
            flag = any(a.startswith("--retriever-t") for a in (sys.argv[1:] if argv is None else argv))
            p.error(f"{'--retriever-tier' if flag else 'DRL_RETRIEVER_TIER'}={typed!r} must be one of {', '.join(TIERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from ..manifest import ContractMismatch
    from .loop import Worker, WorkerSettings

    stop = threading.Event()

    def on_signal(signum, _frame):
        if stop.is_set():  # a second signal: leave now (nothing half-written: uploads are single puts)
            raise KeyboardInterrupt
        logging.getLogger("worker").info("signal %d: finishing the group in hand, then stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    settings = {k: v for k, v in dict(
        store=args.store, run=args.run, model_dir=args.model, worker_id=args.worker_id, max_groups=args.groups,
        seed=args.seed, threads=args.threads, max_groups_per_version=args.max_groups_per_version,
        idle_after_s=args.idle_after,
        wait_timeout_s=args.wait, log_every_s=args.log_every, lag_versions=args.lag_versions,
        backend=args.backend, mlx_dtype=args.mlx_dtype, batch_groups=args.batch_groups,
        retriever_url=args.retriever_url, retriever_tier=args.retriever_tier, max_turns=args.max_turns,
    ).items() if v is not None}
    try:
        Worker(WorkerSettings(**settings)).run(stop)
    except ContractMismatch as e:
        print(f"worker refuses to join: {e}", file=sys.stderr)
        return 3
    except (ValueError, TimeoutError) as e:
        from ..cli import one_sentence

        print(f"worker error: {one_sentence(e)}", file=sys.stderr)  # a bad setting: one line, not pydantic's table
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    from ..cli import run_main

    sys.exit(run_main(main, "python -m worker_contract.worker"))
