"""Invoke tasks over the worker contract (read-only: nothing here changes a machine or a bucket)."""

from __future__ import annotations

from pathlib import Path

from .taskkit import REPO_ROOT, stoa_task


@stoa_task(help={
    "run": "run id (default: DRL_RUN)",
    "store": "store URL (default: DRL_STORE, else r2://$R2_BUCKET, else the repo's file store)",
    "env-file": "credentials file (default: .r2env in the repo root; must be mode 0600)",
    "format": "text | env | json",
    "reveal": "include the secret values (hand the card over privately); it has no short flag on purpose",
    "out": "write the card to this file, mode 0600, instead of printing it (a bare name such as card.env goes "
           "to ~/.stoa/cards/; a revealed card is refused inside this repository)",
    "retriever-url": "the fleet's retriever URL (default: DRL_RETRIEVER_URL)",
})
def joincard(c, run=None, store=None, env_file=None, format="text", reveal=False, out=None, retriever_url=None):
    """Print the join card of a run: what a worker needs to join it. Secrets redacted unless --reveal."""
    from worker_contract.joincard import joincard as make_card

    wrote: list[Path] = []
    text = make_card(REPO_ROOT, run=run, store=store, env_file=env_file, fmt=format, reveal=reveal,
                     out=out, retriever_url=retriever_url, wrote=wrote)
    print(f"wrote the join card to {wrote[0]} (mode 0600)" if out else text)
