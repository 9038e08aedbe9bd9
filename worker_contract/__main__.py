"""`python -m worker_contract verify --store URL --run RUN`: check a run's published weights."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker_contract", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="walk every published version from the anchors; exit 1 on any failure")
    v.add_argument("--store", required=True, help="store URL (file:///abs/path, s3://bucket, r2://bucket)")
    v.add_argument("--run", required=True, help="run id (DRL_RUN)")
    args = parser.parse_args(argv)

    from .store import open_store
    from .verify import verify_run

    try:
        store = open_store(args.store)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if verify_run(store, args.run) else 1


if __name__ == "__main__":
    sys.exit(main())
