"""Ed25519 signatures over the objects that steer workers (pointer, anchor manifests, patch headers).

The trainer holds the run's private key (mode 0600 beside the credentials); its public key is in
`run.json` and its fingerprint on the join card. Anyone with bucket credentials can write objects, but only
the trainer can sign them, so a worker refuses a forged pointer, manifest or patch.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


class SignatureError(ValueError):
    """A signature is missing, malformed, or does not verify under the run's public key."""


def generate_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def save_private_key(key: Ed25519PrivateKey, path: str | Path) -> None:
    """Write the key as PEM with mode 0600, created exclusively (never overwrites a run's key)."""
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    path = Path(path)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ValueError(f"{path} has mode {mode:04o}; a signing key must be private: chmod 600 {path}")
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    return key


def load_or_create_private_key(path: str | Path) -> Ed25519PrivateKey:
    path = Path(path)
    if path.exists():
        return load_private_key(path)
    key = generate_private_key()
    save_private_key(key, path)
    return key


def public_key_b64(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The raw 32-byte public key, base64: the form stored in run.json."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def fingerprint(public_b64: str) -> str:
    """OpenSSH-style fingerprint (SHA256:<base64, no padding>) of a raw public key, for the join card."""
    digest = hashlib.sha256(base64.b64decode(public_b64)).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def body_bytes(obj, context: bytes) -> bytes:
    """What a signed object's signature covers: `context` (which kind of object) and its fields but
    `signature`, as canonical JSON (sorted keys, no spaces). `obj`: a pydantic model with a `signature`."""
    body = obj.model_dump(mode="json", exclude={"signature"})
    return context + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(key: Ed25519PrivateKey, message: bytes) -> str:
    return base64.b64encode(key.sign(message)).decode()


def verify(public_b64: str, message: bytes, signature_b64: str | None) -> None:
    """Raise `SignatureError` unless `signature_b64` is the run key's signature of `message`."""
    if not signature_b64:
        raise SignatureError("object is not signed")
    try:
        pub = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_b64, validate=True))
        pub.verify(base64.b64decode(signature_b64, validate=True), message)
    except (InvalidSignature, ValueError) as e:
        raise SignatureError(f"signature does not verify under the run's key {fingerprint(public_b64)}") from e
