"""`file:///abs/path`: a directory standing in for a bucket (the embedded default, and tests).

Keys map to paths under the root. Writes go to a temporary file in the same directory, are fsynced, then
renamed into place, so a reader never sees a partial object. Create-only uses `os.link`, which fails if the
name exists, so of racing writers exactly one wins. Compare-and-swap holds an `fcntl` lock on a per-key lock
file, which serialises writers across processes on one machine (the file store's scope).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .base import NotFound, ObjectInfo, PreconditionFailed, Store

_TMP_PREFIX = ".tmp-"
_LOCK_SUFFIX = ".stoa-lock"
_CHUNK = 8 << 20


def _etag_of_file(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename or link in `path` durable (the directory entry, not just the file, must reach disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileStore(Store):
    def __init__(self, root: str | Path):
        root = Path(root)
        if not root.is_absolute():
            raise ValueError(f"file store root {str(root)!r} must be an absolute path (file:///abs/path)")
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = f"file://{root}"

    # -- paths -------------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
            raise ValueError(f"invalid store key {key!r}")
        if key.rsplit("/", 1)[-1].startswith(_TMP_PREFIX) or key.endswith(_LOCK_SUFFIX):
            raise ValueError(f"store key {key!r} uses a name reserved by the file store")
        return self.root / key

    def _tmp_for(self, path: Path) -> tuple[int, Path]:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
        return fd, Path(name)

    def _write_tmp(self, path: Path, data: bytes) -> Path:
        fd, tmp = self._tmp_for(path)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def _commit(self, tmp: Path, path: Path, *, if_absent: bool) -> None:
        try:
            if if_absent:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise PreconditionFailed(f"{self._key(path)} already exists") from None
            else:
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)

    def _key(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    @contextlib.contextmanager
    def _locked(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(str(path) + _LOCK_SUFFIX, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # -- interface -----------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(f"{key} not found in {self.url}") from None

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        data = self.get(key)
        return data, hashlib.md5(data, usedforsecurity=False).hexdigest()

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            return ObjectInfo(key=key, size=path.stat().st_size, etag=_etag_of_file(path))
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> str:
        path = self._path(key)
        self._commit(self._write_tmp(path, data), path, if_absent=False)
        return hashlib.md5(data, usedforsecurity=False).hexdigest()

    def put_if_absent(self, key: str, data: bytes) -> str:
        path = self._path(key)
        self._commit(self._write_tmp(path, data), path, if_absent=True)
        return hashlib.md5(data, usedforsecurity=False).hexdigest()

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        path = self._path(key)
        with self._locked(path):
            info = self.head(key)
            if info is None:
                raise NotFound(f"{key} not found in {self.url}")
            if info.etag != etag.strip('"'):
                raise PreconditionFailed(f"{key} changed (ETag {info.etag}, expected {etag})")
            return self.put(key, data)

    def _keys(self, prefix: str, start_after: str | None) -> list[str]:
        """The keys under `prefix` after `start_after`, sorted: a walk of only the directory the prefix names
        (its last complete segment), filtered by the rest. Keys are made with string operations: pathlib's
        per-file objects were most of a listing's time, and the learner and every worker list on each poll."""
        base_key = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        root = os.fspath(self.root)
        base = os.path.join(root, base_key) if base_key else root
        if not os.path.isdir(base):
            return []
        cut = len(os.path.join(root, ""))  # a directory's key is its path after the root and one separator
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            rel = dirpath[cut:].replace(os.sep, "/")
            head = rel + "/" if rel else ""
            for name in filenames:
                if name.startswith(_TMP_PREFIX) or name.endswith(_LOCK_SUFFIX):
                    continue
                key = head + name
                if key.startswith(prefix) and (start_after is None or key > start_after):
                    keys.append(key)
        return sorted(keys)

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[ObjectInfo]:
        for key in self._keys(prefix, start_after):
            info = self.head(key)
            if info is not None:
                yield info

    def list_keys(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        # list's ObjectInfo carries each file's ETag, the MD5 of all its bytes: the keys alone need a stat
        root = os.fspath(self.root)
        return [key for key in self._keys(prefix, start_after) if os.path.isfile(os.path.join(root, key))]

    def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with contextlib.suppress(FileNotFoundError):
            Path(str(path) + _LOCK_SUFFIX).unlink()

    def upload_file(self, key: str, path: str | Path, *, if_absent: bool = False) -> str:
        dest = self._path(key)
        fd, tmp = self._tmp_for(dest)
        try:
            with os.fdopen(fd, "wb") as out, open(path, "rb") as src:
                shutil.copyfileobj(src, out, _CHUNK)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        etag = _etag_of_file(tmp)
        self._commit(tmp, dest, if_absent=if_absent)
        return etag

    def download_file(self, key: str, path: str | Path) -> None:
        src = self._path(key)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(src, "rb") as f:
                fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
                try:
                    with os.fdopen(fd, "wb") as out:
                        shutil.copyfileobj(f, out, _CHUNK)
                    os.replace(tmp, path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
        except FileNotFoundError:
            raise NotFound(f"{key} not found in {self.url}") from None

    def open_read(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except FileNotFoundError:
            raise NotFound(f"{key} not found in {self.url}") from None
