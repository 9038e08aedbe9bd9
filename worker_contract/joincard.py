"""The join card: exactly what a worker needs to join a run, handed over out of band (docs/r2-setup.md section 5).

The contract values come from the run's published `run.json` (the authority a worker checks itself
against); the bucket values and the retriever URL come from the operator's environment. Secrets print as
asterisks unless `reveal` is set; `write_card` creates its file with mode 0600 from the first byte.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, SecretStr

from . import env as envmod
from .manifest import ContractMismatch, format_diff, load_manifest, model_id_is_a_path
from .signing import fingerprint
from .store import NotFound, Store, open_store
from .tasks import get_task, is_task
from .tasks.psqa_retrieval import check_url

FORMATS = ("text", "env", "json")
Format = Literal["text", "env", "json"]


class JoinCardError(ValueError):
    """The card cannot be made (no run.json, bad option); the message says what to do."""


class JoinCard(BaseModel):
    """One run's join card. `entries()` is its wire form: env variable, value, whether it is secret."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    run: str
    """DRL_RUN: the run id (bucket prefix)."""
    n_samples: int
    """DRL_N_SAMPLES: group size, from run.json."""
    plane: str
    """DRL_PULSE_PLANE: weight plane, from run.json."""
    kv_mode: str | None = None
    """DRL_KV_MODE: workers' KV-cache mode, from run.json (omitted when the run sets none)."""
    trainer_key_fingerprint: str
    """Fingerprint of run.json's trainer_public_key; a worker compares it before trusting the run."""
    retriever_url: str | None = None
    """DRL_RETRIEVER_URL: the fleet's search service (PaperSearchQA); None when the run needs none."""
    task: str | None = None
    """run.json's task; the card of a task that searches (its `services` name the retriever) says how each
    memory tier joins (not an env variable)."""
    model_id: str = ""
    """run.json's model_id; a card whose model is a directory on the trainer's machine says to copy it."""
    store: str
    """The store URL the trainer uses (r2://, s3:// or file://)."""
    s3_endpoint: str | None = None
    """DRL_S3_ENDPOINT for an s3:// store on a server other than AWS."""
    r2_account_id: str | None = None
    """R2_ACCOUNT_ID (r2:// stores)."""
    r2_bucket: str | None = None
    """R2_BUCKET (r2:// stores)."""
    access_key_var: str = "R2_ACCESS_KEY_ID"
    """Which variable pair carries the credentials (R2_* or AWS_*)."""
    access_key_id: SecretStr | None = None
    """The access key id (secret)."""
    secret_access_key: SecretStr | None = None
    """The secret access key (secret)."""

    def entries(self) -> list[tuple[str, str | SecretStr, bool]]:
        scheme = urlparse(self.store).scheme
        out: list[tuple[str, str | SecretStr, bool]] = []
        if scheme == "r2":
            out.append(("R2_ACCOUNT_ID", self.r2_account_id or "", False))
        else:
            out.append(("DRL_STORE", self.store, False))
            if self.s3_endpoint:
                out.append(("DRL_S3_ENDPOINT", self.s3_endpoint, False))
        if self.access_key_id is not None and self.secret_access_key is not None:
            prefix = self.access_key_var.split("_", 1)[0]
            out.append((f"{prefix}_ACCESS_KEY_ID", self.access_key_id, True))
            out.append((f"{prefix}_SECRET_ACCESS_KEY", self.secret_access_key, True))
        if scheme == "r2":
            out.append(("R2_BUCKET", self.r2_bucket or "", False))
        out += [("DRL_RUN", self.run, False), ("DRL_N_SAMPLES", str(self.n_samples), False),
                ("DRL_PULSE_PLANE", self.plane, False)]
        if self.kv_mode:
            out.append(("DRL_KV_MODE", self.kv_mode, False))
        out.append(("DRL_TRAINER_KEY_FINGERPRINT", self.trainer_key_fingerprint, False))
        if self.retriever_url:
            out.append(("DRL_RETRIEVER_URL", self.retriever_url, False))
        return out

    def env(self, *, reveal: bool) -> dict[str, str]:
        """The card as a worker's environment: with `reveal`, secrets included (a worker this process starts
        itself); without, redacted (a card shown to people)."""
        return {name: (value.get_secret_value() if reveal else envmod.REDACTED) if isinstance(value, SecretStr)
                else value for name, value, _ in self.entries()}


def _check_env_agrees(contract: envmod.EnvContract, env: Mapping[str, str], card: JoinCard) -> None:
    """Fail closed when the operator's own DRL_* values contradict the run they are handing out."""
    diff = []
    if env.get("DRL_N_SAMPLES", "").strip() and contract.n_samples != card.n_samples:
        diff.append(("n_samples", card.n_samples, contract.n_samples))
    if contract.plane is not None and contract.plane != card.plane:
        diff.append(("plane", card.plane, contract.plane))
    if contract.kv_mode is not None and contract.kv_mode != card.kv_mode:
        diff.append(("kv_mode", card.kv_mode, contract.kv_mode))
    if diff:
        raise ContractMismatch(f"the environment contradicts run {card.run!r}'s run.json:\n"
                               + format_diff(diff, "run.json", "environment")
                               + "\nunset those variables or fix them; the card states run.json's values")


def build_card(store: Store, run: str, env: Mapping[str, str], retriever_url: str | None = None) -> JoinCard:
    """The card of `run` in `store`; `env` is the effective environment (see env.load_env)."""
    contract = envmod.parse_env(env)
    try:
        manifest = load_manifest(store, run)
    except NotFound:
        raise JoinCardError(f"run {run!r} has no run.json in {store.url}: start its trainer first (it "
                            "publishes run.json), or check DRL_RUN and DRL_STORE") from None
    retriever_url = retriever_url or env.get("DRL_RETRIEVER_URL", "").strip() or None
    if retriever_url:
        try:
            check_url(retriever_url)
        except ValueError:
            raise JoinCardError(f"retriever URL {retriever_url!r} must be an http:// or https:// URL with a host, "
                                "e.g. http://10.0.0.5:8000") from None
    parsed = urlparse(store.url)
    use_r2 = parsed.scheme == "r2" or bool(env.get("R2_ACCESS_KEY_ID") and env.get("R2_SECRET_ACCESS_KEY"))
    var = "R2_ACCESS_KEY_ID" if use_r2 else "AWS_ACCESS_KEY_ID"
    key_id, secret = env.get(var), env.get(var.replace("ACCESS_KEY_ID", "SECRET_ACCESS_KEY"))
    card = JoinCard(
        run=manifest.run, n_samples=manifest.n_samples, plane=manifest.plane, kv_mode=manifest.kv_mode,
        trainer_key_fingerprint=fingerprint(manifest.trainer_public_key), retriever_url=retriever_url,
        task=manifest.task, model_id=manifest.model_id, store=store.url, s3_endpoint=(env.get("DRL_S3_ENDPOINT") or None) if parsed.scheme == "s3" else None,
        r2_account_id=env.get("R2_ACCOUNT_ID") if parsed.scheme == "r2" else None,
        r2_bucket=parsed.netloc if parsed.scheme == "r2" else None, access_key_var=var,
        access_key_id=SecretStr(key_id) if key_id and parsed.scheme != "file" else None,
        secret_access_key=SecretStr(secret) if secret and parsed.scheme != "file" else None,
    )
    _check_env_agrees(contract, env, card)
    return card


def render(card: JoinCard, fmt: str = "text", reveal: bool = False) -> str:
    """The card as `text` (for people), `env` (to source) or `json` (for scripts)."""
    if fmt not in FORMATS:
        raise JoinCardError(f"--format={fmt!r} is not a card format; use one of: {', '.join(FORMATS)}")

    rows = list(card.env(reveal=reveal).items())
    hidden = not reveal and any(secret for _, _, secret in card.entries())
    if fmt == "json":
        return json.dumps(dict(rows), indent=2)
    copy = (f"the model is {card.model_id}, a directory on the trainer's machine (no hub holds it): copy its "
            "config.json, tokenizer files and chat_template.jinja (if it has one) to the worker and start it "
            "with --model DIR"
            if model_id_is_a_path(card.model_id) else "")
    if fmt == "env":
        head = [f"# join card of run {card.run}: source it, then start a worker"]
        if hidden:
            head.append("# secrets redacted; the operator can print them with --reveal")
        if copy:
            head.append(f"# {copy}")
        return "\n".join(head + [f"{k}={shlex.quote(v)}" for k, v in rows])
    width = max(len(k) for k, _ in rows)
    lines = [f"Join card for run {card.run}", ""] + [f"  {k.ljust(width)}  {v}" for k, v in rows]
    if card.task and is_task(card.task) and "retriever" in get_task(card.task).services:  # a search task: how each tier joins
        if not card.retriever_url:
            lines.append(f"  {'DRL_RETRIEVER_URL'.ljust(width)}  (not set; the fleet task needs one: "
                         "--retriever-url or DRL_RETRIEVER_URL)")
        lines += ["", "Join (docs/mac-worker.md), with these values in the environment:",
                  "  a Mac:     python -m worker_contract.worker --backend mlx",
                  "  any box:   python -m worker_contract.worker --backend torch",
                  "  light tier (15-23 GB) searches through DRL_RETRIEVER_URL; medium (24-47 GB) and heavy may",
                  "  serve a local index (python -m infra.retriever build, then serve) and point DRL_RETRIEVER_URL",
                  "  at it; --retriever-tier light|medium|heavy overrides the tier read from the memory"]
    if copy:
        lines += ["", copy[0].upper() + copy[1:] + "."]
    if hidden:
        lines += ["", "Secrets are redacted; rerun with --reveal to include them (hand the card over privately)."]
    return "\n".join(lines)


def write_card(text: str, out: str | Path) -> Path:
    """Write `text` to `out` with mode 0600: a private temp file (mkstemp makes it 0600) renamed into place,
    so the card is never readable by others, not even for an instant, whatever the umask or old file."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text if text.endswith("\n") else text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


#: where a card given by bare name (`--out card.env`) is written: never inside a checkout
CARDS_DIR = Path("~/.stoa/cards")


def card_path(out: str | Path, repo_root: str | Path, *, secret: bool) -> Path:
    """Where `--out` writes: a bare file name under ~/.stoa/cards/ (mode 0700), any other path as given.
    A card holding a secret is refused inside `repo_root`: files there are one `git add` (or one shipped
    tree) away from leaving the machine."""
    given = Path(out).expanduser()
    if not str(out).strip() or given.name in ("", ".", ".."):
        raise JoinCardError(f"--out {str(out)!r} names no file: give the card's file name (e.g. --out card.env)")
    if "/" not in str(out):  # `card.env`, not `./card.env` (Path drops the "./")
        cards = CARDS_DIR.expanduser()
        cards.mkdir(mode=0o700, parents=True, exist_ok=True)
        return _may_replace(cards / given.name, out)
    path = _may_replace(Path.cwd() / given, out).resolve()
    root = Path(repo_root).resolve()
    if secret and path.is_relative_to(root):
        raise JoinCardError(f"--out {out} is inside the repository {root}, and a revealed card holds the secret "
                            f"key: write it outside the tree (a bare name such as --out {given.name} goes to "
                            f"{CARDS_DIR / given.name})")
    return path


#: how each card format begins (`render`): the only files `--out` replaces
_CARD_STARTS = ("Join card for run ", "# join card of run ", "{")


def _may_replace(path: Path, out: str | Path) -> Path:
    """`path` unless writing there would destroy something that is not a card: a symbolic link (the card
    would replace its target), a directory, or a file no `--out` wrote (JoinCardError says which)."""
    if path.is_symlink():
        raise JoinCardError(f"--out {out} is a symbolic link (to {os.readlink(path)}); the card would replace "
                            "its target: name a plain file")
    if path.is_dir():
        raise JoinCardError(f"--out {out} is a directory: name the card's file (e.g. {path / 'card.env'})")
    if path.exists():
        try:
            with open(path, encoding="utf-8") as f:
                head = f.read(4096)
        except (OSError, UnicodeDecodeError):
            head = ""
        if not head.startswith(_CARD_STARTS) or (head.startswith("{") and '"DRL_RUN"' not in head):
            raise JoinCardError(f"--out {out} exists and is not a join card; the card never overwrites another "
                                "file: name a new one")
    return path


def joincard(repo_root: str | Path, *, run: str | None = None, store: str | None = None,
             env_file: str | None = None, fmt: str = "text", reveal: bool = False, out: str | None = None,
             retriever_url: str | None = None, environ: Mapping[str, str] | None = None,
             wrote: list[Path] | None = None) -> str:
    """The `invoke joincard` flow: load the environment, open the store, build and render (and write) the card
    (where: `card_path`, appended to `wrote`)."""
    if fmt not in FORMATS:
        raise JoinCardError(f"--format={fmt!r} is not a card format; use one of: {', '.join(FORMATS)}")
    env = envmod.load_env(environ, env_file=env_file, repo_root=repo_root)
    run = run or envmod.parse_env(env).require_run("join")
    url = envmod.check_store_url(store) if store else envmod.default_store_url(env, repo_root)
    card = build_card(open_store(url, env), run, env, retriever_url=retriever_url)
    text = render(card, fmt, reveal)
    if out:
        secret = reveal and any(is_secret for _, _, is_secret in card.entries())
        path = write_card(text, card_path(out, repo_root, secret=secret))
        if wrote is not None:
            wrote.append(path)
    return text
