"""`python -m worker_contract verify [--store URL] [--run RUN] [--env-file PATH]`: check a run's published weights.

Credentials and defaults come as for every other entry point (worker_contract.env): the environment, over
the env file (`.r2env` in the current directory unless `--env-file` names one; it must be mode 0600).
`--store` defaults to DRL_STORE, else r2://$R2_BUCKET when the four R2 values are set, else the embedded
file store under the current directory; `--run` defaults to DRL_RUN.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker_contract", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    what = "walk every published version from the anchors; exit 1 on any failure"
    v = sub.add_parser("verify", help=what, description=f"Check a run's published weights: {what}.")
    v.add_argument("--store", help="store URL: file:///abs/path, s3://bucket, r2://bucket (default: DRL_STORE, "
                                   "else r2://$R2_BUCKET with the four R2 values, else ./.stoa/bucket)")
    v.add_argument("--run", help="run id (default: DRL_RUN)")
    v.add_argument("--quiet", "-q", action="store_true",
                   help="print only failures and the summary line (a long run has a line per version)")
    v.add_argument("--env-file", help="credentials file (default: .r2env in the current directory if it "
                                      "exists; must be mode 0600); the environment wins over it")
    args = parser.parse_args(argv)

    from urllib.parse import urlparse

    from .env import load_env, redact, store_url
    from .layout import check_run_id, manifest_key, run_prefix
    from .store import StoreError, open_store
    from .verify import verify_run

    try:
        env = load_env(env_file=args.env_file, repo_root=Path.cwd())
        run = args.run or env.get("DRL_RUN", "").strip()
        if not run:
            raise ValueError("no run given: pass --run RUN or set DRL_RUN (in the environment or the env file)")
        check_run_id(run)
        url = store_url(args.store, env, Path.cwd())
        if url.startswith("file://") and not Path(urlparse(url).path).is_dir():  # read-only: never create it
            raise ValueError(f"run {run!r} is not here: there is no store at {url}; pass --store or set "
                             "DRL_STORE to the run's bucket")
        store = open_store(url, env)
        if store.head(manifest_key(run)) is None and next(iter(store.list(run_prefix(run))), None) is None:
            # nothing of the run at all: a wrong run id or store is bad input; a run.json gone from a run's objects
            # is a damaged run, which the check reports (exit 1)
            raise ValueError(f"run {run!r} has no run.json in {redact(url)}: check --run (or DRL_RUN) and --store")
        return 0 if verify_run(store, run, quiet=args.quiet) else 1
    except (ValueError, StoreError) as e:  # store errors pass through redaction: no secret in them
        from .cli import one_sentence

        print(f"error: {one_sentence(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from .cli import run_main

    sys.exit(run_main(main, "python -m worker_contract"))
