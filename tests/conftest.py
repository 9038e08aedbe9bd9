"""Shared fixtures: a real S3 server on loopback (moto's ThreadedMotoServer), stores on both backends, and
the fault-injecting proxy (bench/faultproxy.py). Network never leaves 127.0.0.1.

    moto_server   session-wide S3 server with the bucket `stoa-test`; `.env()` gives a store environment,
                  `.new_bucket()` a fresh empty bucket
    s3_store      an S3Store on a fresh bucket of that server (isolated per test)
    file_store    a FileStore under tmp_path
    store         parametrized over both backends: a test using it runs once per backend
    fault_proxy   a FaultProxy in front of the server (rate 0 until the test injects faults)
    temp_home     (autouse) an empty HOME per test, inherited by every process the test starts
"""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests' helpers (invariants, ...) import by name
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # bench/ (the fault proxy) from any working dir

from leftovers import register as register_leftovers  # noqa: E402
from recipe_base import FIXTURE as RECIPE_BASE  # noqa: E402
from recipe_base import (  # noqa: E402,F401
    pytest_configure_node,
    pytest_sessionfinish,
    pytest_xdist_node_collection_finished,
    recipe_base,
)
from recipe_base import schedule as schedule_recipe_base  # noqa: E402
from sshd import hold_privsep_dir, release_privsep_dir  # noqa: E402


def pytest_configure(config):
    hold_privsep_dir(config)  # one /run/sshd for every xdist worker's sshd (tests/sshd.py)
    register_leftovers(config)  # processes the tests left running, named and ended (tests/leftovers.py)


def pytest_unconfigure(config):
    release_privsep_dir()


#: under pytest-xdist (`--dist loadfile`, noxfile.py) a worker runs a whole test module, so module-scoped
#: fixtures are built once; these modules share one worker too. test_bad_inputs runs its whole table in one
#: module fixture (`outcomes`); test_preflight's box rows run on this machine (directly or over its sshd) and
#: one of them listens on 0.0.0.0:8265, the Ray dashboard port box.ray_dashboard reads, where the native
#: launch's learner (test_native_loop_on_cpu) serves its dashboard, and where test_remote's stand-in for a
#: dashboard that cannot list jobs listens. Keys: a module, or one test of a module
XDIST_GROUPS = {"tests/test_preflight.py": "port-8265",
                "tests/test_native_launch.py::test_native_loop_on_cpu": "port-8265",
                "tests/test_remote.py::test_stop_does_not_say_nothing_runs_when_rays_jobs_are_unknown": "port-8265"}
#: modules whose tests each make a unit of their own (a worker each, at the same time): each test holds several
#: minutes of real processes, and they share nothing costly (a module fixture is built again per worker)
XDIST_SPLIT = ("tests/test_embedded_e2e.py", "tests/test_secret_scan.py", "tests/test_resume.py",
               "tests/test_fleet.py", "tests/test_native_launch.py")
#: seconds each long test took in a run of the whole suite (tests/durations.json: `--durations`, 3 workers on
#: the 2-core box, setup included): the units are handed out longest first
DURATIONS: dict[str, float] = json.loads((Path(__file__).parent / "durations.json").read_text())


def xdist_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, its module's group, or (XDIST_SPLIT) itself."""
    path, test = nodeid.split("::", 1)[0], nodeid.split("[", 1)[0]
    for key in (test, path):
        if key in XDIST_GROUPS:
            return XDIST_GROUPS[key]
    return nodeid if path in XDIST_SPLIT else path


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own choice of scheduler
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid)

    return Scheduling(config, log)


def _seconds(item) -> float:
    """How long a test is expected to take: its measured figure, else a guess by its markers."""
    if item.nodeid in DURATIONS:
        return DURATIONS[item.nodeid]
    return 30.0 if item.get_closest_marker("slow") else 3.0 if item.get_closest_marker("integration") else 0.3


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, hand out the units of work longest first (their tests' DURATIONS summed) and the
    short ones last, so no worker starts a minutes-long test while the others have run out of work (a worker
    holds the next unit while it runs its last test); a module waiting for the recipe's base goes last
    (tests/recipe_base.py). Every worker sorts its identical collection the same way, and a unit's tests
    keep their order in the module."""
    result = yield  # after every other plugin's: -m / -k have deselected what will not run
    if hasattr(config, "workerinput"):
        total: dict[str, float] = {}
        for item in items:
            unit = xdist_unit(item.nodeid)
            waits = RECIPE_BASE in getattr(item, "fixturenames", ())
            total[unit] = float("-inf") if waits or total.get(unit) == float("-inf") else \
                total.get(unit, 0.0) + _seconds(item)
        order = {unit: rank for rank, unit in enumerate(sorted(total, key=lambda u: -total[u]))}
        items.sort(key=lambda item: order[xdist_unit(item.nodeid)])  # stable: a unit keeps its module order
    schedule_recipe_base(config, items)
    return result


#: credentials moto accepts (it does not check them); distinct enough to look for in output
TEST_ACCESS_KEY = "AKIASTOATESTACCESS01"
TEST_SECRET_KEY = "stoa-test-secret-key-do-not-print-0123456789"


#: the user's home as pytest found it: only read (its pip.conf), never written to
_USER_HOME = Path.home()
_XDG_DIRS = ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")


@pytest.fixture(autouse=True)
def temp_home(tmp_path_factory, monkeypatch) -> Path:
    """An empty HOME for each test and every process it starts with the inherited environment, so what
    they save under ~ (Ray's auth token, matplotlib's font cache, pip's cache, ...) never lands in the
    user's home. XDG_* are unset so they follow HOME; the user's pip.conf stays readable (package index)."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    for var in _XDG_DIRS:
        monkeypatch.delenv(var, raising=False)
    pip_conf = _USER_HOME / ".config" / "pip" / "pip.conf"
    if "PIP_CONFIG_FILE" not in os.environ and pip_conf.is_file():
        monkeypatch.setenv("PIP_CONFIG_FILE", str(pip_conf))
    return home


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class MotoServer:
    endpoint: str
    bucket: str

    def env(self, endpoint: str | None = None, **extra: str) -> dict[str, str]:
        """An environment for `open_store("s3://<bucket>", env)` against this server (or a proxy)."""
        return {"DRL_S3_ENDPOINT": endpoint or self.endpoint, "AWS_REGION": "us-east-1",
                "AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": TEST_SECRET_KEY, **extra}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=TEST_ACCESS_KEY, aws_secret_access_key=TEST_SECRET_KEY)

    def new_bucket(self) -> str:
        name = f"t-{uuid.uuid4().hex[:20]}"
        self.client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="module")
def dist():
    """A gloo process group and megatron's parallel state for one test module (tests/megatron_cpu.py)."""
    from tests import megatron_cpu

    megatron_cpu.init_distributed()
    yield
    megatron_cpu.shutdown_distributed()


@pytest.fixture(scope="session")
def moto_server():
    import logging

    from moto.server import ThreadedMotoServer

    from worker_contract.env import register_secret

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one access-log line per request otherwise
    for value in (TEST_ACCESS_KEY, TEST_SECRET_KEY):  # redacted in captured logs, as real credentials are
        register_secret(value)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        ms = MotoServer(endpoint=f"http://127.0.0.1:{port}", bucket="stoa-test")
        ms.client().create_bucket(Bucket=ms.bucket)
        yield ms
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(moto_server) -> str:
    return moto_server.new_bucket()


@pytest.fixture
def s3_store(moto_server, s3_bucket):
    from worker_contract.store.s3 import S3Store

    return S3Store.from_url(f"s3://{s3_bucket}", moto_server.env())


@pytest.fixture
def file_store(tmp_path):
    from worker_contract.store.file import FileStore

    return FileStore(tmp_path / "bucket")


@pytest.fixture(params=["file", "s3"])
def store(request):
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture
def fault_proxy(moto_server):
    from bench.faultproxy import FaultProxy

    with FaultProxy(moto_server.endpoint, seed=1234) as proxy:
        yield proxy
