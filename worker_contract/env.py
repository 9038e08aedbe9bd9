"""The env contract (docs/r2-setup.md section 5): parse and validate `DRL_*`, load credentials, keep secrets secret.

Credentials come from an env file (default `.r2env` in the repo root) that must be private (mode 0600),
and from the environment, which wins over the file. Secret values are held as `SecretStr` (their repr is
`'**********'`) and registered with `redact()`, which every error message of the store passes through and
which a log-record factory applies to every log line of the process, third-party libraries included
(botocore's DEBUG log prints the Authorization header, which names the access key id).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from . import layout
from .planes import PLANES as PLANE_MODULES
from .planes import PlaneName

DEFAULT_ENV_FILE = ".r2env"
#: the four values a joiner needs to reach the bucket (docs/r2-setup.md section 5)
R2_VARS = ("R2_ACCOUNT_ID", "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY", "R2_BUCKET")
#: variables whose values are secrets wherever they come from
SECRET_VARS = frozenset({"R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID",
                         "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"})
#: variables holding URLs that may carry a password (`http://user:pass@host`): it is redacted
URL_VARS = ("DRL_S3_ENDPOINT", "DRL_STORE", "DRL_RETRIEVER_URL", "DRL_EVAL_ENDPOINT")
STORE_SCHEMES = ("file", "r2", "s3")
REDACTED = "**********"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class EnvError(ValueError):
    """An environment variable or env file is malformed; the message names the variable and the fix."""


# -- redaction ----------------------------------------------------------------------------------------
_secrets: tuple[str, ...] = ()  # longest first; replaced whole under the lock, so readers need none
_secrets_lock = threading.Lock()
_factory_installed = False


def register_secret(value: str | SecretStr | None) -> None:
    """Redact `value` from every later error message and log line of this process."""
    global _factory_installed, _secrets
    raw = value.get_secret_value() if isinstance(value, SecretStr) else value
    if not raw or len(raw) < 4:  # a 1-3 character "secret" would redact ordinary text
        return
    with _secrets_lock:
        _secrets = tuple(sorted(set(_secrets) | {raw}, key=len, reverse=True))
        if not _factory_installed:
            previous = logging.getLogRecordFactory()

            def factory(*args, **kwargs):
                record = previous(*args, **kwargs)
                try:
                    text = record.getMessage()
                except Exception:  # a malformed call: leave it to the handler's own error path
                    return record
                clean = redact(text)
                if clean != text:
                    record.msg, record.args = clean, None
                if record.exc_info and not record.exc_text:
                    record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
                return record

            logging.setLogRecordFactory(factory)
            _factory_installed = True


#: `scheme://<userinfo>@` in any URL, up to its last `@` before the path: the user name (often an access key)
#: and the password (which may hold an `@`) are credentials wherever they appear
_URL_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^/\s]*)@")


def redact(text: str) -> str:
    """`text` with every registered secret value, and the credentials written inside a URL, replaced by asterisks."""
    for s in _secrets:
        if s in text:
            text = text.replace(s, REDACTED)
    return _URL_USERINFO.sub(lambda m: f"{m['head']}{REDACTED}@", text)


def _register_url_password(url: str | None) -> None:
    """The credentials written inside an endpoint URL (`http://user:pass@host`) are secrets like any other:
    the user name and the password each."""
    if url and (m := _URL_USERINFO.search(url)):
        user, _, password = m["info"].partition(":")
        for part in (user, password, m["info"]):
            if len(part) >= 4:  # a one-letter user name would redact that letter everywhere
                register_secret(part)


# -- env file -----------------------------------------------------------------------------------------
#: a comment after an unquoted value: whitespace, then `#` (a value that holds ` #` is written quoted)
_INLINE_COMMENT = re.compile(r"\s+#")


def _parse_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines, `#` comments, optional `export ` and quotes.

    Written by hand instead of using python-dotenv: the contract core stays at its five dependencies, and
    an error here may name the line number only, never echo the line (it may hold a secret).
    """
    out: dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise EnvError(f"{path} is not UTF-8 text: it holds KEY=VALUE lines (see .r2env.example)") from None
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.replace("_", "").isalnum() or key[0].isdigit():
            raise EnvError(f"{path}:{n}: expected KEY=VALUE (line not shown: it may hold a secret)")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif (m := _INLINE_COMMENT.search(value)) is not None:  # `KEY=value  # note`: the note is no part of it
            value = value[:m.start()]
        out[key] = value
    return out


def read_env_file(path: str | Path) -> dict[str, str]:
    """Read a credentials file, refusing one that anybody but its owner can read or write."""
    path = Path(path)
    if path.is_dir():  # (a pipe is fine: --env-file <(pass show r2))
        raise EnvError(f"{path} is a directory: an env file holds KEY=VALUE lines (see .r2env.example)")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise EnvError(
            f"{path} has mode {mode:04o}: it holds credentials and must be readable by its owner only; "
            f"fix it with: chmod 600 {path}"
        )
    values = _parse_env_file(path)
    for key, value in values.items():
        if key in SECRET_VARS:
            register_secret(value)
    return values


def load_env(env: Mapping[str, str] | None = None, env_file: str | Path | None = None,
             repo_root: str | Path | None = None) -> dict[str, str]:
    """The effective environment: the env file's values, overridden by non-empty environment values.

    `env_file` None means `<repo_root>/.r2env` if it exists; an explicit path must exist.
    """
    env = dict(os.environ if env is None else env)
    if env_file is None:
        root = Path(repo_root) if repo_root is not None else Path.cwd()
        candidate = root / DEFAULT_ENV_FILE
        if candidate.exists() and not candidate.is_file() and not candidate.is_dir():  # a FIFO: reading waits
            raise EnvError(f"{candidate} is not a regular file (a pipe or device: reading it would wait for a "
                           "writer); make it a file of KEY=VALUE lines, or pass a pipe as --env-file explicitly")
        file_values = read_env_file(candidate) if candidate.exists() else {}
    else:
        if not Path(env_file).exists():
            raise EnvError(f"env file {env_file} does not exist; create it from .r2env.example (mode 0600)")
        file_values = read_env_file(env_file)
    merged = {**file_values, **{k: v for k, v in env.items() if v != ""}}
    for key in SECRET_VARS & merged.keys():
        register_secret(merged[key])
    for key in URL_VARS:
        _register_url_password(merged.get(key))
    return merged


# -- the contract -------------------------------------------------------------------------------------
class EnvContract(BaseModel):
    """The cross-host values of docs/r2-setup.md section 5, validated. Secrets repr as asterisks."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    run: str | None = None
    """DRL_RUN: the run id and bucket prefix `<run>/`; None when unset."""
    n_samples: int = Field(8, ge=1)
    """DRL_N_SAMPLES: the group size; a group of any other size is dropped."""
    plane: PlaneName | None = None
    """DRL_PULSE_PLANE: the weight plane; None when unset (the recipe decides)."""
    kv_mode: str | None = None
    """DRL_KV_MODE: the workers' KV-cache mode (the fleet requires paged_prefix)."""
    store: str | None = None
    """DRL_STORE: the store URL; None = R2 when its four values exist, else the embedded file store."""
    dry_run: bool = False
    """DRL_DRY_RUN: print the resolved launch and exit."""
    r2_account_id: str | None = None
    """R2_ACCOUNT_ID: names the endpoint https://<id>.r2.cloudflarestorage.com (not a secret)."""
    r2_access_key_id: SecretStr | None = None
    """R2_ACCESS_KEY_ID: the API token's access key id (secret)."""
    r2_secret_access_key: SecretStr | None = None
    """R2_SECRET_ACCESS_KEY: the API token's secret (secret)."""
    r2_bucket: str | None = None
    """R2_BUCKET: the bucket both sides use."""

    def require_run(self, action: str = "start") -> str:
        """The run id; `action` says what it is for: "start" a run (a fresh id) or "join" one (its own id)."""
        if self.run is None:
            if action == "join":
                raise EnvError("DRL_RUN is not set: name the run to join, --run <its id> or DRL_RUN=<its id>")
            raise EnvError("DRL_RUN is not set: choose a fresh run id, e.g. DRL_RUN=gsm8k-2026-11-30a")
        return self.run

    @property
    def has_r2(self) -> bool:
        """All four R2 values are present."""
        return all((self.r2_account_id, self.r2_access_key_id, self.r2_secret_access_key, self.r2_bucket))


def env_int(name: str, value: str, minimum: int | None = None, example: int | None = None) -> int:
    """`value` of variable (or flag) `name` as an integer: `8`, not `8.0`, `abc` or `1e3`."""
    text = value.strip()
    out = int(text) if re.fullmatch(r"[+-]?[0-9]+", text) else None
    if out is None or (minimum is not None and out < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        example = example if example is not None else max(minimum or 0, 8)
        raise EnvError(f"{name}={value!r} must be an integer{bound} (for example {name}={example})")
    return out


def env_bool(name: str, value: str) -> bool:
    """`value` of variable `name` as a strict boolean: a typo (`y`, `2`, `dry`) is refused, never read as off."""
    v = value.strip().lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise EnvError(f"{name}={value!r} must be 1 or 0 (also accepted: true/false, yes/no, on/off)")


#: a bucket name R2 and S3 both accept
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def check_store_url(url: str, source: str = "DRL_STORE") -> str:
    """A store URL the stores understand, refused otherwise; `source` names where the user wrote it
    (DRL_STORE, --store). The URL is echoed with any password in it redacted."""
    from urllib.parse import urlparse

    shown = redact(url)
    usage = "file:///abs/path, r2://<bucket> or s3://<bucket>"
    if "://" not in url:
        raise EnvError(f"{source}={shown!r} must be {usage} (it has no scheme)")
    p = urlparse(url)
    if p.scheme not in STORE_SCHEMES:
        raise EnvError(f"{source}={shown!r} must be {usage} (unknown scheme {p.scheme!r})")
    if p.scheme == "file" and (p.netloc not in ("", "localhost") or not p.path.startswith("/")):
        raise EnvError(f"{source}={shown!r}: a file store URL is file:///abs/path (three slashes)")
    if p.scheme != "file" and not p.netloc:
        raise EnvError(f"{source}={shown!r} names no bucket: use {p.scheme}://<bucket>")
    if p.scheme != "file" and (p.path.strip("/") or p.query or p.params or p.fragment or "@" in p.netloc):
        raise EnvError(f"{source}={shown!r}: a bucket URL is {p.scheme}://<bucket> alone (no path, query or "
                       "credentials: the run is the prefix inside it, credentials come from .r2env)")
    if p.scheme != "file" and not _BUCKET.match(p.netloc):
        raise EnvError(f"{source}={shown!r}: {p.netloc!r} is not a bucket name (3-63 lowercase letters, digits, "
                       "dots and hyphens; no port: the endpoint is DRL_S3_ENDPOINT)")
    if url != url.strip():
        raise EnvError(f"{source}={shown!r} has spaces around it: write the URL alone")
    return url


def parse_env(env: Mapping[str, str] | None = None) -> EnvContract:
    """Validate the contract variables of `env` (default os.environ); each error names variable and fix."""
    env = os.environ if env is None else env

    def get(name: str) -> str | None:
        v = env.get(name)
        return None if v is None or v.strip() == "" else v.strip()

    values: dict[str, object] = {}
    if (run := get("DRL_RUN")) is not None:
        try:
            values["run"] = layout.check_run_id(run)
        except ValueError as e:
            raise EnvError(str(e)) from None
    if (n := get("DRL_N_SAMPLES")) is not None:
        values["n_samples"] = env_int("DRL_N_SAMPLES", n, 1)
    if (plane := get("DRL_PULSE_PLANE")) is not None:
        if plane not in PLANE_MODULES:
            raise EnvError(f"DRL_PULSE_PLANE={plane!r} must be one of: {', '.join(PLANE_MODULES)}")
        values["plane"] = plane
    if (kv := get("DRL_KV_MODE")) is not None:
        if not kv.replace("_", "").replace("-", "").isalnum():
            raise EnvError(f"DRL_KV_MODE={kv!r} must be a mode name like paged_prefix")
        values["kv_mode"] = kv
    if (store := get("DRL_STORE")) is not None:
        values["store"] = check_store_url(store)
    values["dry_run"] = env_bool("DRL_DRY_RUN", env.get("DRL_DRY_RUN", ""))
    _register_url_password(env.get("DRL_S3_ENDPOINT"))
    for var in R2_VARS:
        if (v := get(var)) is not None:
            if var in SECRET_VARS:
                register_secret(v)
                values[var.lower()] = SecretStr(v)
            else:
                values[var.lower()] = v
    return EnvContract(**values)


def r2_configured(env: Mapping[str, str]) -> bool:
    """All four R2 values are set; an EnvError naming the empty ones when only some are (a half-filled
    .r2env never falls back to the local file store in silence)."""
    present = [v for v in R2_VARS if env.get(v, "").strip()]
    if present and len(present) < len(R2_VARS):
        missing = [v for v in R2_VARS if v not in present]
        raise EnvError(f"R2 is half configured: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                       f"empty while {', '.join(present)} {'is' if len(present) == 1 else 'are'} set; fill "
                       "every R2 value in .r2env (docs/r2-setup.md) or clear them all to use the local file store")
    return bool(present)


def default_store_url(env: Mapping[str, str], repo_root: str | Path) -> str:
    """DRL_STORE if set; else r2://$R2_BUCKET when all four R2 values exist; else the repo's file store.
    A half-configured R2 is an EnvError, never the file store."""
    if env.get("DRL_STORE", "").strip():
        return check_store_url(env["DRL_STORE"].strip())
    if r2_configured(env):
        return f"r2://{env['R2_BUCKET'].strip()}"
    return f"file://{Path(repo_root).resolve() / '.stoa' / 'bucket'}"


def store_url(override: str | None, env: Mapping[str, str], repo_root: str | Path,
              source: str = "--store") -> str:
    """The store a command uses: `override` (a flag, named `source` in errors) else `default_store_url`."""
    return check_store_url(override, source) if override else default_store_url(env, repo_root)
