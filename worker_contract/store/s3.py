"""`r2://<bucket>` and `s3://<bucket>`: the store on Cloudflare R2 or any S3-compatible server, via boto3.

- Checksums are calculated and validated only when an operation requires them (botocore >= 1.36 otherwise
  sends aws-chunked CRC32 trailers, which R2 has refused); every single PUT carries Content-MD5 instead.
- Retries are botocore's "standard" mode: 5xx, 429 (R2 answers racing writers on one key with it),
  connection errors and timeouts, with jittered exponential backoff. 412 is not retryable there, so a
  precondition failure reaches the caller as `PreconditionFailed` after exactly one request.
- A conditional write whose first attempt landed but whose answer was lost is retried by botocore and
  then gets 412 against its own object; when the object's ETag is that of our bytes, that is a success.
- Multipart parts are all the same size (R2 rejects unequal parts), the last one excepted.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import math
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlparse

from pydantic import SecretStr

from ..env import redact, register_secret
from .base import NotFound, ObjectInfo, PreconditionFailed, Store, StoreError

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB  # S3 and R2 minimum for every part but the last
MAX_PARTS = 10_000
DEFAULT_PART_SIZE = 16 * MiB
BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
ACCOUNT_RE = re.compile(r"^[A-Za-z0-9]{1,64}$")


def _unquote(etag: str) -> str:
    return etag.strip('"')


def _md5(data: bytes) -> tuple[str, str]:
    """(hex, base64) MD5 of `data`: the ETag S3 and R2 give a single PUT, and its Content-MD5 header."""
    d = hashlib.md5(data, usedforsecurity=False).digest()
    return d.hex(), base64.b64encode(d).decode()


def _meta(e) -> dict:
    return e.response.get("ResponseMetadata", {})


def _code(e) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


class S3Store(Store):
    """One bucket on an S3-compatible server; thread-safe (one boto3 client, shared)."""

    def __init__(self, bucket: str, *, scheme: str = "s3", endpoint: str | None = None,
                 region: str = "us-east-1", access_key: str | SecretStr | None = None,
                 secret_key: str | SecretStr | None = None, session_token: str | SecretStr | None = None,
                 max_attempts: int = 8, connect_timeout: float = 10.0, read_timeout: float = 60.0,
                 part_size: int = DEFAULT_PART_SIZE, max_concurrency: int = 8, session=None):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        if not BUCKET_RE.match(bucket):
            raise ValueError(f"bucket {bucket!r} is not a valid bucket name: 3-63 characters of a-z, 0-9, "
                             "'.' and '-', starting and ending with a letter or digit")
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size={part_size} is below the S3/R2 minimum of {MIN_PART_SIZE} bytes")
        self.bucket, self.endpoint, self.part_size = bucket, endpoint, part_size
        self.max_concurrency = max_concurrency
        self.url = f"{scheme}://{bucket}"

        def raw(v: str | SecretStr | None) -> str | None:
            register_secret(v)
            return v.get_secret_value() if isinstance(v, SecretStr) else v

        config = Config(
            region_name=region,
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"mode": "standard", "total_max_attempts": max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max(32, 2 * max_concurrency),
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        # A boto3 session loads the S3 service model once (about 13 MB and 0.4 s); many stores in one
        # process (a fleet simulator's hundreds of clients) pass one session and share it.
        self._client = (session or boto3.session.Session()).client(
            "s3", endpoint_url=endpoint, config=config, aws_access_key_id=raw(access_key),
            aws_secret_access_key=raw(secret_key), aws_session_token=raw(session_token))
        # Fixed chunk size = equal parts; s3transfer only ever doubles it (still equal) past 10,000 parts.
        self._transfer = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size,
                                        max_concurrency=max_concurrency)

    def __repr__(self) -> str:
        return f"S3Store(url={self.url!r}, endpoint={self.endpoint!r})"

    @classmethod
    def from_url(cls, url: str, env: Mapping[str, str], **kwargs) -> S3Store:
        """`r2://<bucket>` (R2_ACCOUNT_ID, R2_ACCESS_KEY_ID, R2_SECRET_ACCESS_KEY) or `s3://<bucket>`
        (DRL_S3_ENDPOINT, AWS_REGION; R2_* credentials, else AWS_*, else boto3's own chain)."""
        p = urlparse(url)
        if p.username or p.password:  # never echo this URL: it carries a credential
            raise ValueError("DRL_STORE must not carry credentials (user:secret@); put them in .r2env")
        if p.scheme not in ("r2", "s3") or p.path not in ("", "/") or p.query or p.port:
            raise ValueError(f"DRL_STORE={url!r}: expected r2://<bucket> or s3://<bucket> (no path: the run "
                             "id is the prefix inside the bucket)")
        get = lambda name: (env.get(name) or "").strip() or None  # noqa: E731
        if p.scheme == "r2":
            needed = ("R2_ACCOUNT_ID", "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY")
            missing = [v for v in needed if not get(v)]
            if missing:
                raise ValueError(f"DRL_STORE={url!r} needs {', '.join(missing)}: fill .r2env (mode 0600) "
                                 "as docs/r2-setup.md shows, or export them")
            account = get("R2_ACCOUNT_ID")
            if not ACCOUNT_RE.match(account):
                raise ValueError(f"R2_ACCOUNT_ID={account!r} is not an account id (32 hex characters, "
                                 "shown on the R2 overview page)")
            jurisdiction = get("R2_JURISDICTION")  # eu / fedramp buckets live on their own endpoint
            if jurisdiction not in (None, "eu", "fedramp"):
                raise ValueError(f"R2_JURISDICTION={jurisdiction!r} must be unset, 'eu' or 'fedramp'")
            host = f"{account}.{jurisdiction + '.' if jurisdiction else ''}r2.cloudflarestorage.com"
            return cls(p.netloc, scheme="r2", endpoint=f"https://{host}", region="auto",
                       access_key=get("R2_ACCESS_KEY_ID"), secret_key=get("R2_SECRET_ACCESS_KEY"), **kwargs)
        endpoint = get("DRL_S3_ENDPOINT")
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"DRL_S3_ENDPOINT={endpoint!r} must be an http:// or https:// URL")
        if endpoint is not None:
            from urllib.parse import urlsplit

            try:
                urlsplit(endpoint).port  # noqa: B018 (parses the host and port: '[::1' or ':abc' fail here)
            except ValueError as e:
                raise ValueError(f"DRL_S3_ENDPOINT={endpoint!r} is not a valid URL ({e})") from None
        r2_creds = get("R2_ACCESS_KEY_ID") and get("R2_SECRET_ACCESS_KEY")
        return cls(
            p.netloc, scheme="s3", endpoint=endpoint,
            region=get("AWS_REGION") or get("AWS_DEFAULT_REGION") or "us-east-1",
            access_key=get("R2_ACCESS_KEY_ID") if r2_creds else get("AWS_ACCESS_KEY_ID"),
            secret_key=get("R2_SECRET_ACCESS_KEY") if r2_creds else get("AWS_SECRET_ACCESS_KEY"),
            session_token=None if r2_creds else get("AWS_SESSION_TOKEN"), **kwargs)

    # -- errors ------------------------------------------------------------------------------------------
    def _fail(self, e: Exception, op: str, key: str) -> StoreError:
        from botocore.exceptions import ClientError

        if isinstance(e, ClientError):
            status, code = _meta(e).get("HTTPStatusCode", 0), _code(e)
            if code == "NoSuchBucket":
                return StoreError(f"bucket {self.bucket!r} does not exist at {self.endpoint or 'AWS S3'}")
            if status == 404 or code in ("NoSuchKey", "NotFound"):
                return NotFound(f"{key} not found in {self.url}")
            # 409 ConditionalRequestConflict: AWS's answer to a conditional write racing another; we lost.
            if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return PreconditionFailed(f"{key} in {self.url}: precondition failed ({code or status})")
            msg = e.response.get("Error", {}).get("Message", "")
            return StoreError(redact(f"{op} {key!r} in {self.url} failed: HTTP {status} {code}: {msg}"))
        return StoreError(redact(f"{op} {key!r} in {self.url} failed: {type(e).__name__}: {e}"))

    @contextlib.contextmanager
    def _errors(self, op: str, key: str):
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (ClientError, BotoCoreError, Boto3Error) as e:
            raise self._fail(e, op, key) from None

    def _landed(self, e, key: str, etag: str) -> bool:
        """After a retried conditional write got 412: is the object there ours (our first attempt landed)?"""
        if _meta(e).get("HTTPStatusCode") != 412 or not _meta(e).get("RetryAttempts"):
            return False
        info = self.head(key)
        return info is not None and info.etag == etag

    # -- interface ---------------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self.get_with_etag(key)[0]

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        with self._errors("get", key):
            r = self._client.get_object(Bucket=self.bucket, Key=key)
            with contextlib.closing(r["Body"]) as body:
                return body.read(), _unquote(r["ETag"])

    def head(self, key: str) -> ObjectInfo | None:
        try:
            with self._errors("head", key):
                r = self._client.head_object(Bucket=self.bucket, Key=key)
        except NotFound:
            return None
        return ObjectInfo(key=key, size=r["ContentLength"], etag=_unquote(r["ETag"]))

    def _put(self, key: str, data: bytes, **condition: str) -> str:
        from botocore.exceptions import ClientError

        hexd, b64 = _md5(data)
        with self._errors("put", key):
            try:
                r = self._client.put_object(Bucket=self.bucket, Key=key, Body=data, ContentMD5=b64, **condition)
            except ClientError as e:
                if condition and self._landed(e, key, hexd):
                    return hexd
                raise
        return _unquote(r["ETag"])

    def put(self, key: str, data: bytes) -> str:
        return self._put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> str:
        return self._put(key, data, IfNoneMatch="*")

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        return self._put(key, data, IfMatch=f'"{_unquote(etag)}"')

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[ObjectInfo]:
        kwargs = {"Bucket": self.bucket, "Prefix": prefix}
        if start_after is not None:
            kwargs["StartAfter"] = start_after
        with self._errors("list", prefix):
            for page in self._client.get_paginator("list_objects_v2").paginate(**kwargs):
                for o in page.get("Contents", []):
                    yield ObjectInfo(key=o["Key"], size=o["Size"], etag=_unquote(o["ETag"]))

    def delete(self, key: str) -> None:
        try:
            with self._errors("delete", key):
                self._client.delete_object(Bucket=self.bucket, Key=key)
        except NotFound:
            pass

    def upload_file(self, key: str, path: str | Path, *, if_absent: bool = False) -> str:
        if if_absent:
            return self._upload_create_only(key, Path(path))
        with self._errors("upload", key):
            self._client.upload_file(str(path), self.bucket, key, Config=self._transfer)
        info = self.head(key)  # upload_file returns nothing; the ETag is the object's
        if info is None:
            raise StoreError(f"upload {key!r} in {self.url}: object missing right after upload")
        return info.etag

    def _part_size_for(self, size: int) -> int:
        need = math.ceil(size / MAX_PARTS)
        return max(self.part_size, math.ceil(need / MiB) * MiB)

    def _upload_create_only(self, key: str, path: Path) -> str:
        """Create-only upload. boto3's managed upload accepts no IfNoneMatch (s3transfer's
        ALLOWED_UPLOAD_ARGS), so a large file goes through the low-level multipart calls with
        If-None-Match: * on CompleteMultipartUpload, the step that makes the object visible."""
        size = path.stat().st_size
        if size <= self.part_size:
            return self.put_if_absent(key, path.read_bytes())
        if self.exists(key):  # fail before sending gigabytes; the condition on Complete is what counts
            raise PreconditionFailed(f"{key} in {self.url}: precondition failed (exists)")
        part = self._part_size_for(size)
        count = math.ceil(size / part)

        with self._errors("upload", key):
            upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        digests: list[bytes] = [b""] * count

        def send(i: int) -> dict:
            with open(path, "rb") as f:
                body = os.pread(f.fileno(), min(part, size - i * part), i * part)
            hexd, b64 = _md5(body)
            digests[i] = bytes.fromhex(hexd)
            r = self._client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                         PartNumber=i + 1, Body=body, ContentMD5=b64)
            return {"PartNumber": i + 1, "ETag": r["ETag"]}

        from botocore.exceptions import ClientError
        try:
            with self._errors("upload", key):
                with ThreadPoolExecutor(self.max_concurrency) as pool:
                    parts = list(pool.map(send, range(count)))
                expected = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest() + f"-{count}"
                try:
                    r = self._client.complete_multipart_upload(
                        Bucket=self.bucket, Key=key, UploadId=upload_id,
                        MultipartUpload={"Parts": parts}, IfNoneMatch="*")
                except ClientError as e:
                    if self._landed(e, key, expected):
                        return expected
                    raise
                return _unquote(r["ETag"])
        except BaseException:
            with contextlib.suppress(Exception):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    def download_file(self, key: str, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        os.close(fd)
        try:
            with self._errors("download", key):
                self._client.download_file(self.bucket, key, tmp, Config=self._transfer)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def open_read(self, key: str) -> BinaryIO:
        with self._errors("open", key):
            return self._client.get_object(Bucket=self.bucket, Key=key)["Body"]
