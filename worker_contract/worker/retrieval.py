"""The worker's search tool for PaperSearchQA runs: which retriever, by memory tier, and refusals up front.

Tiers (runs/psqa-decoupled/REPRODUCE.md): light 15-23 GB cannot hold the BM25 index and must use the
shared retriever of the join card (DRL_RETRIEVER_URL); medium (24-47 GB) and heavy (48 GB and up) may
serve a local memory-mapped index (`python -m infra.retriever build`, then `serve`) on 127.0.0.1 and
point DRL_RETRIEVER_URL at it. The tier follows the machine's memory; --retriever-tier overrides it.
"""

from __future__ import annotations

import logging
import os
from urllib.parse import urlparse

from ..tasks.psqa_retrieval import RetrieverClient, search_tool

log = logging.getLogger("worker")
TIERS = ("auto", "light", "medium", "heavy")
GB = 1024**3


def machine_memory_bytes() -> int:
    """Physical memory (Linux and macOS), 0 when it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def tier_for(memory_bytes: int) -> str:
    """light below 24 GB (a 16-24 GB Mac), medium below 48 GB, heavy above; unknown memory counts as light."""
    if memory_bytes < 24 * GB:
        return "light"
    return "medium" if memory_bytes < 48 * GB else "heavy"


def resolve_tier(tier: str) -> str:
    if tier not in TIERS:
        raise ValueError(f"retriever tier {tier!r} is not one of {', '.join(TIERS)}")
    return tier_for(machine_memory_bytes()) if tier == "auto" else tier


def make_search(url: str | None, tier: str, run: str, k: int = 3, timeout_s: float = 20.0, retries: int = 2):
    """The strict `Search` callable of a psqa worker (a failure raises RetrieverError: the group is dropped);
    a ValueError (exit 2) naming DRL_RETRIEVER_URL when there is no retriever to use."""
    tier = resolve_tier(tier)
    if not url:
        if tier == "light":
            raise ValueError(f"run {run!r} trains psqa and this light-tier worker cannot hold the search index: "
                             "set DRL_RETRIEVER_URL (or --retriever-url) to the join card's shared retriever")
        raise ValueError(f"run {run!r} trains psqa and needs a retriever: set DRL_RETRIEVER_URL (or "
                         "--retriever-url) to the join card's shared retriever, or on this "
                         f"{tier}-tier machine to a local one (python -m infra.retriever build, then serve)")
    client = RetrieverClient(url, timeout_s=timeout_s, retries=retries)
    host = urlparse(client.url).hostname or ""
    if tier == "light" and host in ("127.0.0.1", "localhost", "::1"):
        log.warning("light-tier worker using a retriever on this machine (%s): its index competes with the "
                    "model for memory", client.url)
    log.info("retriever %s (%s tier)", client.url, tier)
    return search_tool(client, k=k, strict=True)
