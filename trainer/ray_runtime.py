"""Starting Ray the same way on a laptop and a GPU box, and moving stores and keys into actors.

`ray_session(run_dir)` joins RAY_ADDRESS / `address` when given (a cluster the operator runs), and
otherwise starts a local single-machine Ray that listens on 127.0.0.1 only, with the dashboard off,
nothing written to the home directory, its temp dir under the run dir and usage statistics off.
Nothing here runs at import time.
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import secrets
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from worker_contract.store import Store, open_store

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent

#: room Ray needs after its temp dir for "/session_<date>_<usec>_<pid>/sockets/plasma_store"
_SOCKET_SUFFIX = 64
_UNIX_PATH_MAX = 107
#: environment a store client may need in an actor (no other variable is forwarded)
_STORE_ENV_PREFIXES = ("DRL_S3_", "R2_", "AWS_")


def ray_tmpdir(run_dir: str | Path) -> tuple[Path, bool]:
    """Ray's temp dir for this run (RAY_TMPDIR) and whether it is the short fallback outside the run dir. Ray
    makes that folder world-writable each time one of its processes starts, so it sits inside a folder only
    the run's owner can enter (`.parent`, kept 0700 by `ray_session`)."""
    preferred = Path(run_dir).resolve() / "ray" / "r"
    if len(str(preferred)) + _SOCKET_SUFFIX <= _UNIX_PATH_MAX:
        return preferred, False
    digest = hashlib.sha256(str(preferred).encode()).hexdigest()[:12]
    return Path(f"/tmp/stoa-ray-{digest}") / "r", True


def _private_dir(path: Path) -> None:
    """`path` as a directory only its owner can enter (Ray's sockets accept any local user who can reach
    them); one in /tmp that another user made first is refused, never used."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user: Ray's sockets there would be theirs to reach; "
                              "remove it or move the run dir to a shorter path")
    os.chmod(path, 0o700)


#: tries of a local Ray start. Its raylet waits about 15 s for the dashboard agent (a Python process) to report
#: its ports and aborts when it has not: on a busy 2-core machine the agent's imports alone can take longer.
#: Ray offers no setting for that wait, so a start that times out is ended and made again. Three tries
#: were not enough on the 2-core CI box with the whole suite running (3 timeouts in a row, 2 suites of 4).
_START_ATTEMPTS = 5

_ENV_KEYS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_TMPDIR", "RAY_USAGE_STATS_ENABLED", "RAY_worker_niceness", "PYTHONPATH",
             "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")


@contextlib.contextmanager
def ray_session(run_dir: str | Path, *, address: str | None = None, num_cpus: int | None = None,
                env: Mapping[str, str] | None = None) -> Iterator[None]:
    """Ray started (or joined) for the body of the `with`; shut down after, if we started it."""
    env = os.environ if env is None else env
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        yield  # the caller owns a Ray session already: use it as it is
        return
    address = address or env.get("RAY_ADDRESS") or None
    saved = {k: os.environ.get(k) for k in _ENV_KEYS}
    fallback_dir: Path | None = None
    try:
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        if address is None:
            tmp, is_fallback = ray_tmpdir(run_dir)
            _private_dir(tmp.parent)
            if is_fallback:
                fallback_dir = tmp.parent
                (Path(run_dir) / "ray.path").write_text(f"{tmp.parent}\n")
                log.info("Ray temp dir %s (the run dir path is too long for Ray's sockets)", tmp)
            os.environ["RAY_TMPDIR"] = str(tmp)
            # Ray's worker processes inherit this environment: make our packages importable there too
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), saved["PYTHONPATH"]) if p)
            # Ray starts its workers at nice 15; ours is the learner, the box's main job, which at nice 15
            # yields the CPU to the rollout workers and the retriever beside it (an operator's value stands)
            os.environ["RAY_worker_niceness"] = env.get("RAY_worker_niceness", "0")
            _loopback_only()
            _set_auth(env)
            dashboard = env.get("DRL_RAY_DASHBOARD", "") not in ("", "0")
            kwargs: dict = dict(_temp_dir=str(tmp), include_dashboard=dashboard, dashboard_host="127.0.0.1",
                                num_cpus=num_cpus)
            if dashboard:
                kwargs["dashboard_port"] = int(env.get("DRL_RAY_DASHBOARD_PORT", "8265"))
        else:
            kwargs = dict(address=address)
        import ray

        ctx = _init(address is None, **kwargs, log_to_driver=True, configure_logging=False)
        if address is None and ctx.address_info.get("node_ip_address") != "127.0.0.1":
            log.warning("Ray's node address is %s, not loopback", ctx.address_info.get("node_ip_address"))
        try:
            yield
        finally:
            ray.shutdown()
        if fallback_dir is not None:
            shutil.rmtree(fallback_dir, ignore_errors=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def init_standalone(*, num_cpus: int | None = None) -> None:
    """`ray.init` for a component used outside the learner loop (a multi-rank backend built on its own):
    the same loopback-only, no-usage-stats, no-token-file setup as `ray_session`, for the process's life."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    _loopback_only()
    _set_auth(os.environ)
    _init(True, include_dashboard=False, dashboard_host="127.0.0.1", num_cpus=num_cpus, log_to_driver=True,
          configure_logging=False)


def _init(local: bool, **kwargs):
    """`ray.init(**kwargs)`; a local start that timed out is ended (the processes it started, by PID) and
    made again, up to _START_ATTEMPTS in all."""
    import psutil
    import ray

    me = psutil.Process()
    for attempt in range(1, _START_ATTEMPTS + 1):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            return ray.init(**kwargs)
        except Exception as e:  # Ray raises a bare Exception for this
            if not local or "timed out during startup" not in str(e) or attempt == _START_ATTEMPTS:
                raise
            started = [p for p in me.children(recursive=True) if p.pid not in before]
            for p in started:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(started, timeout=30)
            ray.shutdown()
            log.warning("Ray's node did not come up in time (attempt %d of %d; a busy machine starts its "
                        "agents slowly): ended its %d processes, starting it again", attempt, _START_ATTEMPTS,
                        len(started))


def _loopback_only() -> None:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read by every Ray process at import
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # this process imported Ray before: its copy of the switch is already read
        constants.ENABLE_RAY_CLUSTER = False


def _set_auth(env: Mapping[str, str]) -> None:
    mode = os.environ.get("RAY_AUTH_MODE")
    if not mode:  # a mode already here is the user's, or one a bare ray.init() left in this process
        mode = env.get("DRL_RAY_AUTH", "disabled") or "disabled"
        if mode not in ("token", "disabled"):
            raise ValueError(f"DRL_RAY_AUTH={mode!r} must be 'disabled' (default) or 'token'")
        os.environ["RAY_AUTH_MODE"] = mode
        if mode == "token":
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # in memory only: never written to a file
    # Ray reads its config once per process; refresh it the way ray.init does when it turns token auth on
    # itself, in case this process imported Ray before the mode was set
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()
    # Ray's own lookup (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token); with none found, ray.init
    # would generate a token and save it under HOME
    if mode.lower() == "token" and not loader.has_token(ignore_auth_mode=True):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        loader.reset_cache()
        log.info("RAY_AUTH_MODE=token and no Ray token to load: using a fresh one kept in memory")


# -- moving things into actors -----------------------------------------------------------------------
def store_spec(store: Store, env: Mapping[str, str] | None = None) -> tuple[str, object]:
    """Something an actor can rebuild the store from: the store itself if it pickles, else its URL and
    the store variables of `env` (credentials travel to our own actors in memory, never to a file)."""
    try:
        pickle.dumps(store)
        return ("pickle", store)
    except Exception:
        env = os.environ if env is None else env
        return ("url", (store.url, {k: v for k, v in env.items() if k.startswith(_STORE_ENV_PREFIXES)}))


def open_store_spec(spec: tuple[str, object]) -> Store:
    kind, value = spec
    if kind == "pickle":
        return value  # type: ignore[return-value]
    url, env = value  # type: ignore[misc]
    return open_store(url, env)


def key_to_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def key_from_pem(pem: bytes):
    from cryptography.hazmat.primitives import serialization

    return serialization.load_pem_private_key(pem, password=None)
