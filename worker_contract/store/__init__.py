"""Store clients: `open_store(url)` picks a backend by URL scheme (one registry).

    file:///abs/path   a directory standing in for a bucket (embedded default, tests)
    r2://<bucket>      Cloudflare R2 (endpoint from R2_ACCOUNT_ID, region auto)
    s3://<bucket>      any S3-compatible server (endpoint from DRL_S3_ENDPOINT)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from urllib.parse import urlparse

from .base import NotFound, ObjectInfo, PreconditionFailed, Store, StoreError


def _open_file(url: str, env: Mapping[str, str]) -> Store:
    from .file import FileStore

    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"DRL_STORE={url!r}: a file store URL is file:///abs/path (three slashes)")
    return FileStore(parsed.path)


def _open_s3(url: str, env: Mapping[str, str]) -> Store:
    from .s3 import S3Store

    return S3Store.from_url(url, env)


BACKENDS: dict[str, Callable[[str, Mapping[str, str]], Store]] = {
    "file": _open_file,
    "r2": _open_s3,
    "s3": _open_s3,
}


def open_store(url: str, env: Mapping[str, str] | None = None) -> Store:
    """Open the store a URL names; `env` supplies credentials and endpoints (default: os.environ)."""
    import os

    scheme = urlparse(url).scheme
    if scheme not in BACKENDS:
        raise ValueError(
            f"DRL_STORE={url!r}: unknown store scheme {scheme!r}; known: "
            + ", ".join(f"{s}://" for s in sorted(BACKENDS))
        )
    return BACKENDS[scheme](url, os.environ if env is None else env)


__all__ = ["NotFound", "ObjectInfo", "PreconditionFailed", "Store", "StoreError", "open_store", "BACKENDS"]
