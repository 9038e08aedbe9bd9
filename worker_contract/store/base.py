"""The store interface: the whole wire between trainer and workers is one of these.

Two backends implement it (a file tree and S3-compatible object storage). Semantics every backend keeps:
- `put` is atomic: a reader sees the old object or the new one, never a part.
- `put_if_absent` is create-only (If-None-Match: *): of racing writers exactly one wins, the others get
  `PreconditionFailed`.
- `put_if_match` is compare-and-swap on the ETag (If-Match); a stale ETag gets `PreconditionFailed`.
- `list` yields objects in key order, from `start_after` (exclusive), however many there are.
A precondition failure is an answer, not a fault: it is never retried blindly.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO


class StoreError(Exception):
    """Base class of every store failure."""


class NotFound(StoreError, KeyError):
    """The key does not exist."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "not found"


class PreconditionFailed(StoreError):
    """A create-only or compare-and-swap write lost: the key exists, or its ETag changed."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str


class Store(abc.ABC):
    """One bucket (or one directory standing in for it)."""

    #: the URL this store was opened from, with no secret in it
    url: str

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; `NotFound` if absent."""

    @abc.abstractmethod
    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and its ETag, read together (for a later `put_if_match`)."""

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Size and ETag, or None if absent."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> str:
        """Write (or overwrite) atomically; returns the new ETag."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> str:
        """Create-only write; `PreconditionFailed` if the key exists."""

    @abc.abstractmethod
    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        """Overwrite only if the current ETag is `etag`; `PreconditionFailed` otherwise, `NotFound` if absent."""

    @abc.abstractmethod
    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Objects under `prefix` in key order, strictly after `start_after`."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the key; deleting an absent key is not an error."""

    @abc.abstractmethod
    def upload_file(self, key: str, path: str | Path, *, if_absent: bool = False) -> str:
        """Stream a local file into the store (multipart when large); returns the ETag."""

    @abc.abstractmethod
    def download_file(self, key: str, path: str | Path) -> None:
        """Stream an object to a local file without holding it in memory (written atomically)."""

    @abc.abstractmethod
    def open_read(self, key: str) -> BinaryIO:
        """A readable stream of the object, for objects larger than memory."""

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def list_keys(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        return [o.key for o in self.list(prefix, start_after)]
