"""Every user-facing entry point over a table of bad inputs, in a scratch clone of this repository.

Make targets, Invoke tasks, the nox sessions that take input and the `python -m` CLIs are run as a user
runs them (real processes, the repo's own .venv by path, nothing installed), and each row asserts:
no traceback, the documented exit status (2 for bad input, 1 for a failed check; make itself exits 2 and
nox 1 whatever its recipe returned), a one-sentence error that names what to fix, no secret in any output,
and the clone, its `.stoa` and its `.r2env` unchanged afterwards. Rows run a few at a time, each worker
on its own clone; a row that damaged its clone fails and that worker's next row gets a fresh one. Rows on
a published run get `pub-run` (the real writers) in the bucket, damaged as a credential holder could.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv"

ACCESS_KEY = "AKIDSEKRITACCESS0123"
SECRET_KEY = "sekrit-secret-access-key-0123456789abcdef"
URL_PASSWORD = "hunter2pw-in-endpoint"
SECRETS = (ACCESS_KEY, SECRET_KEY, URL_PASSWORD)

#: the .r2env every row starts from: the example, unfilled (not configured), mode 0600
BASE_R2ENV = "# credentials for the run's bucket\nR2_ACCOUNT_ID=\nR2_ACCESS_KEY_ID=\nR2_SECRET_ACCESS_KEY=\nR2_BUCKET=\n"
FULL_R2ENV = (f"R2_ACCOUNT_ID=0123456789abcdef0123456789abcdef\nR2_ACCESS_KEY_ID={ACCESS_KEY}\n"
              f"R2_SECRET_ACCESS_KEY={SECRET_KEY}\nR2_BUCKET=stoa-bucket\n")
HALF_R2ENV = (f"R2_ACCOUNT_ID=0123456789abcdef0123456789abcdef\nR2_ACCESS_KEY_ID={ACCESS_KEY}\n"
              f"R2_SECRET_ACCESS_KEY={SECRET_KEY}\nR2_BUCKET=\n")
#: local run state the clone holds: a run's metrics and key, another run's log (nothing may touch them)
SEED_FILES = {
    ".stoa/runs/seed-run/metrics.jsonl": '{"step": 1, "reward": 0.5}\n',
    ".stoa/runs/seed-run/trainer.key": "not a real key\n",
    ".stoa/runs/other-run/metrics.jsonl": '{"step": 1}\n',
    "logs/other-run.log": "other run's log\n",
}
#: not part of the clone's state: caches and what tools keep for themselves
IGNORED_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache", ".nox", ".mypy_cache"}
TIMEOUT_S = 40.0


@dataclass
class Row:
    id: str
    argv: list[str]
    rc: int | tuple[int, ...] = 2
    says: tuple[str, ...] = ()
    """Substrings (case-insensitive) the output must hold: the error names what to fix."""
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, tuple[str | bytes, int | None] | str | None] = field(default_factory=dict)
    """Files written into the clone (or under {tmp}/) before the row: (content, mode), a directory (mode None), a
    YAML key's line replaced ("key: value"), or removed (None)."""
    never: tuple[str, ...] = ()
    """Substrings the output must not hold (pydantic internals, field names instead of variables)."""
    lines: int | None = 2
    """At most this many message lines (None: a report, e.g. help or a table of checks)."""
    may_change: tuple[str, ...] = ()
    """Paths of the clone the row may change, with what is under them (`.venv` for `make clean`)."""
    stdin: str = ""
    bucket: str | None = None
    """A published run `pub-run` in the clone's `.stoa/bucket` (the default store), damaged as BUCKET_DAMAGE
    names ("" leaves it whole)."""
    without_cuda: bool = False
    """Only where torch has no CUDA (skipped on a GPU box)."""
    slow: bool = False
    """In the slow lane (a row that does seconds of real work)."""


def _r2env(text: str, mode: int = 0o600) -> dict[str, tuple[str, int]]:
    return {".r2env": (text, mode)}


def _bad_run_json() -> dict[str, tuple[str, int]]:
    return {".stoa/bucket/seed-run/run.json": ("{not json", 0o644)}


PUB = "pub-run"


def _json_at(rel: str, text: str):
    def damage(run_dir: Path) -> None:
        (run_dir / rel).write_text(text)
    return damage


def _stray(rel: str):
    def damage(run_dir: Path) -> None:
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text("not the trainer's")
    return damage


#: how a row damages the published run (anyone with the bucket's credentials can write any of these)
BUCKET_DAMAGE = {
    "": lambda run_dir: None,
    "stats-list": _json_at("stats/v0000000011.json", "[1, 2]"),
    "stats-fields": _json_at("stats/v0000000011.json",
                             '{"metrics": [1], "drops": [2], "workers": {"w1": {"drops": {"stale": "x"}}}}'),
    "stray-patch": _stray("versions/vxyz.pulse"),
    "run-json-list": _json_at("run.json", "[]"),
    "run-json-garbage": _json_at("run.json", "{not json"),
    "pointer-garbage": _json_at("current.json", "{not json"),
}
#: a recipe file of the user's own: the shipped gsm8k with another staleness
_GSM8K = (REPO / "runs" / "gsm8k.yaml").read_text()
MY_RECIPE = {"{tmp}/my-recipe.yaml": (re.sub(r"(?m)^(\s*)staleness:.*$", r"\g<1>staleness: 2", _GSM8K, count=1), 0o644)}
BAD_RECIPE = {"{tmp}/my-recipe.yaml": (re.sub(r"(?m)^(\s*)staleness:.*$", r"\g<1>staleness: -5", _GSM8K, count=1),
                                       0o644)}
PLAN = "----- BEGIN STOA LAUNCH PLAN -----\n{}\n----- END STOA LAUNCH PLAN -----\n"
W = ["python", "-m", "worker_contract.worker", "--run", PUB, "--store", "{store}", "--wait", "1"]

L = ["python", "-m", "entrypoints.launch", "--recipe", "gsm8k"]
DRY = {"DRL_DRY_RUN": "1"}
S3_ENV = {"DRL_S3_ENDPOINT": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": ACCESS_KEY,
          "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

ROWS = [
    # -- make: variables, the environment contract, help, clean ------------------------------------
    Row("make-gsm8k-no-run", ["make", "gsm8k", "PY={fakepy}", "STAMP={tmp}/no-stamp"], says=("usage", "RUN=")),
    Row("make-psqa-no-run", ["make", "psqa", "PY={fakepy}", "STAMP={tmp}/no-stamp"], says=("usage", "RUN=")),
    Row("make-run-injection", ["make", "gsm8k", "RUN=a;touch pwned"], env=DRY, says=("run id",)),
    Row("make-run-quote-injection", ["make", "gsm8k", 'RUN=a"; touch pwned; echo "'], env=DRY, says=("run id",)),
    Row("make-run-space", ["make", "gsm8k", "RUN=my run"], env=DRY, says=("DRL_RUN='my run'", "run id")),
    # DRL_RUN stands for RUN= (the environment the fleet's env file sets): it reaches the launcher, which checks it
    Row("make-drl-run-space", ["make", "gsm8k"], env={**DRY, "DRL_RUN": "my run"}, says=("DRL_RUN='my run'", "run id")),
    Row("make-host-injection", ["make", "gsm8k", "RUN=x", "HOST=h;touch pwned"], env=DRY, says=("HOST=",)),
    Row("make-model-injection", ["make", "gsm8k", "RUN=x", "MODEL=`touch pwned`"], env=DRY, says=("MODEL=",)),
    Row("make-dry-run-y", ["make", "gsm8k", "RUN=x"], env={"DRL_DRY_RUN": "y"}, says=("DRL_DRY_RUN='y'",)),
    Row("make-dry-run-2", ["make", "gsm8k", "RUN=x", "HOST=root@203.0.113.7"], env={"DRL_DRY_RUN": "2"},
        says=("DRL_DRY_RUN='2'",)),
    Row("make-dry-run-word", ["make", "gsm8k", "RUN=x"], env={"DRL_DRY_RUN": "dry"}, says=("DRL_DRY_RUN",)),
    Row("make-host-no-user", ["make", "gsm8k", "RUN=x", "HOST=user@"], env=DRY, says=("HOST='user@'",)),
    Row("make-host-port", ["make", "gsm8k", "RUN=x", "HOST=root@box:99999"], env=DRY, says=("port",)),
    Row("make-dry-host-no-r2", ["make", "gsm8k", "RUN=x", "HOST=root@203.0.113.7"], env=DRY, says=("R2_",),
        lines=None),  # the dry run prints the plan, then the refusal the launch would give
    Row("make-n-samples-abc", ["make", "gsm8k", "RUN=x"], env={**DRY, "DRL_N_SAMPLES": "abc"},
        says=("DRL_N_SAMPLES='abc'",), never=("contract.n_samples", "pydantic")),
    Row("make-n-samples-float", ["make", "gsm8k", "RUN=x"], env={**DRY, "DRL_N_SAMPLES": "8.0"},
        says=("DRL_N_SAMPLES='8.0'",)),
    Row("make-plane", ["make", "gsm8k", "RUN=x"], env={**DRY, "DRL_PULSE_PLANE": "fp4"}, says=("DRL_PULSE_PLANE",)),
    Row("make-store-ftp", ["make", "gsm8k", "RUN=x"], env={**DRY, "DRL_STORE": "ftp://x"}, says=("DRL_STORE",)),
    Row("make-store-ftp-real", ["make", "gsm8k", "RUN=x"], env={"DRL_STORE": "ftp://x"}, says=("DRL_STORE",)),
    Row("make-engine", ["make", "gsm8k", "RUN=x", "ENGINE=fast;touch pwned"], env=DRY, says=("ENGINE='fast;touch pwned'",),
        never=("train.engine",)),
    Row("make-worker", ["make", "gsm8k", "RUN=x", "WORKER=jax"], env=DRY, says=("WORKER='jax'",)),
    Row("make-model-missing", ["make", "gsm8k", "RUN=x", "MODEL=/nonexistent/model"], env=DRY, says=("MODEL=",)),
    Row("make-half-r2env", ["make", "gsm8k", "RUN=x"], env=DRY, files=_r2env(HALF_R2ENV), says=("R2_BUCKET",)),
    Row("make-recipe-yaml", ["make", "gsm8k", "RUN=x"], env=DRY, files={"runs/gsm8k.yaml": ("algo: [1,\n", 0o644)},
        says=("gsm8k.yaml",)),
    Row("make-recipe-staleness", ["make", "gsm8k", "RUN=x"], env=DRY, files={"runs/gsm8k.yaml": "staleness: -5"},
        says=("algo.staleness",)),
    # the learner does not score the nucleus the workers draw from (docs/contract.md): refused, embedded or not
    Row("make-recipe-top-p", ["make", "gsm8k", "RUN=x"], env=DRY, files={"runs/gsm8k.yaml": "top_p: 0.9"},
        says=("algo.top_p=0.9", "top_p: 1.0")),
    Row("make-dry-host-top-p", ["make", "gsm8k", "RUN=x", "HOST=root@203.0.113.7"], env=DRY,
        files={"runs/gsm8k.yaml": "top_p: 0.9"}, says=("algo.top_p=0.9", "top_p: 1.0")),
    Row("make-preflight-empty-stdin", ["make", "preflight"], says=("DRL_DRY_RUN=1",)),
    Row("make-help", ["make", "help"], rc=0, lines=None,
        says=("RUN", "HOST", "MODEL", "SSH_KEY", "REMOTE_DIR", "ENGINE", "WORKER", "DRL_DRY_RUN")),
    Row("make-clean-keeps-stoa", ["make", "clean"], rc=0, lines=None, may_change=(".venv",)),
    # -- the launcher itself ---------------------------------------------------------------------
    Row("launch-help", [*L[:3], "--help"], rc=0, lines=None, says=("DRL_DRY_RUN", "DRL_RUN", "HOST", "embedded")),
    Row("launch-no-recipe", L[:3], says=("--recipe",)),
    # the run id from DRL_RUN; the plan names DRL_STORE's store, the one the run uses, never .stoa/bucket
    Row("launch-run-and-store-from-env", L, rc=0, lines=None,
        env={**DRY, "DRL_RUN": "from-env", "DRL_STORE": "file:///srv/stoa-bucket"},
        says=("from-env", "--store file:///srv/stoa-bucket", "run.json in the store file:///srv/stoa-bucket"),
        never=(".stoa/bucket",)),
    # the reader is gone before the first line is written (`true` reads nothing): BrokenPipeError, quietly
    Row("launch-broken-pipe", ["bash", "-c", "python -m entrypoints.launch --recipe gsm8k --run x | true"],
        rc=0, lines=None, env=DRY),
    # (the preflight writes a probe into the store it checks: a scratch one here)
    Row("preflight-broken-pipe", ["bash", "-c", "python -m infra.preflight --recipe gsm8k --run x "
                                  "--store file://{tmp}/bucket | true"], rc=0, lines=None),
    Row("invoke-broken-pipe", ["bash", "-c", "invoke preflight --recipe gsm8k --run x --store file://{tmp}/bucket "
                               "| true"], rc=0, lines=None),
    # -- invoke status / gc / plot / joincard ----------------------------------------------------------
    Row("status-no-run", ["invoke", "status"], says=("--run",)),
    Row("status-bad-run", ["invoke", "status", "--run", "a/b"], says=("run id",)),
    Row("status-r2env-0644", ["invoke", "status", "--run", "seed-run"], files=_r2env(BASE_R2ENV, 0o644),
        says=("chmod 600",)),
    Row("status-r2env-malformed", ["invoke", "status", "--run", "seed-run"], files=_r2env("this is not env\n"),
        says=(".r2env",)),
    Row("status-r2env-half", ["invoke", "status", "--run", "seed-run"], files=_r2env(HALF_R2ENV),
        says=("R2_BUCKET",)),
    Row("status-store-no-scheme", ["invoke", "status", "--run", "seed-run", "--store", "/tmp/bucket"],
        says=("store",)),
    Row("status-store-ftp-env", ["invoke", "status", "--run", "seed-run"], env={"DRL_STORE": "ftp://x"},
        says=("DRL_STORE",)),
    Row("status-unreachable", ["invoke", "status", "--run", "seed-run", "--store", "s3://stoa-bucket"],
        env=S3_ENV, says=("127.0.0.1:9",)),
    Row("status-endpoint-password", ["invoke", "status", "--run", "seed-run", "--store", "s3://stoa-bucket"],
        env={**S3_ENV, "DRL_S3_ENDPOINT": f"ftp://user:{URL_PASSWORD}@127.0.0.1:9"}, says=("DRL_S3_ENDPOINT",)),
    Row("status-r2-unreachable", ["invoke", "status", "--run", "seed-run"], files=_r2env(FULL_R2ENV),
        says=("r2://stoa-bucket",)),
    Row("status-corrupt-run-json", ["invoke", "status", "--run", "seed-run"], files=_bad_run_json(),
        says=("run.json",)),
    Row("status-missing-run", ["invoke", "status", "--run", "nope"], says=("nope",)),
    Row("gc-keep-abc", ["invoke", "gc", "--run", "seed-run", "--keep-anchors", "abc"], says=("--keep-anchors",)),
    Row("gc-keep-zero", ["invoke", "gc", "--run", "seed-run", "--keep-anchors", "0"], says=("--keep-anchors",)),
    Row("gc-missing-run", ["invoke", "gc", "--run", "nope", "--dry-run"], says=("nope",)),
    Row("gc-corrupt-run-json", ["invoke", "gc", "--run", "seed-run"], files=_bad_run_json(), says=("run.json",)),
    Row("gc-no-store", ["invoke", "gc", "--run", "seed-run", "--keep-anchors", "1"], says=("no store",)),
    Row("plot-no-run", ["invoke", "plot"], says=("--run",)),
    Row("plot-missing-run", ["invoke", "plot", "--run", "nope"], says=("nope",)),
    Row("plot-metrics-garbage", ["invoke", "plot", "--run", "seed-run"],
        files={".stoa/runs/seed-run/metrics.jsonl": ("not json\n[1, 2]\n", 0o644)}, says=("metrics.jsonl", "nothing")),
    Row("joincard-no-run", ["invoke", "joincard"], says=("DRL_RUN", "the run to join"), never=("fresh",)),
    Row("joincard-half-r2env", ["invoke", "joincard", "--run", "seed-run"], files=_r2env(HALF_R2ENV),
        says=("R2_BUCKET",)),
    Row("joincard-v-is-not-reveal", ["invoke", "joincard", "--run", "seed-run", "-v"], rc=1, files=_r2env(FULL_R2ENV),
        says=("-v",)),  # invoke's own parser refuses it (exit 1); it never meant --reveal again
    Row("joincard-format", ["invoke", "joincard", "--run", "seed-run", "--format", "xml"], says=("--format",)),
    Row("joincard-store-ftp", ["invoke", "joincard", "--run", "seed-run", "--store", "ftp://x"], says=("ftp://x",)),
    Row("preflight-task-recipe", ["invoke", "preflight", "--recipe", "nosuch"], says=("nosuch",)),
    # a run id that is no bucket prefix: refused before any check (it was a 'check crashed' FAIL row, exit 1)
    Row("preflight-task-run-slash", ["invoke", "preflight", "--recipe", "gsm8k", "--run", "a/b"],
        says=("--run='a/b'", "run id")),
    Row("preflight-task-run-space", ["invoke", "preflight", "--recipe", "gsm8k", "--run", "my run"],
        says=("--run='my run'", "run id")),
    Row("preflight-cli-drl-run-bad", ["python", "-m", "infra.preflight", "--recipe", "gsm8k"],
        env={"DRL_RUN": "Run 1"}, says=("DRL_RUN='Run 1'", "run id")),
    Row("preflight-task-profile", ["invoke", "preflight", "--recipe", "gsm8k", "--run", "x", "--profile", "nope"],
        says=("--profile",)),
    Row("convert-no-flags", ["invoke", "convert"], says=("--hf-dir",)),
    Row("convert-missing-dir", ["invoke", "convert", "--hf-dir", "/nonexistent", "--out", "{tmp}/out"],
        says=("/nonexistent",)),
    # -- invoke: the trainer box (logs, stop, teardown) ----------------------------------------------
    Row("teardown-purge-no-host", ["invoke", "teardown", "--run", "nope", "--purge"], says=("--host", "--local")),
    Row("teardown-no-host", ["invoke", "teardown", "--run", "nope"], says=("--host", "--local")),
    Row("teardown-local-no-tty", ["invoke", "teardown", "--run", "seed-run", "--local", "--purge"],
        says=("--yes", ".stoa/runs/seed-run"), lines=None),  # names what it would delete, then refuses
    # nothing of seed-run runs: said, with no question to refuse without a terminal (teardown's row asks one)
    Row("stop-local-nothing-running", ["invoke", "stop", "--run", "seed-run", "--local"], rc=0,
        says=("nothing of run seed-run is running", "nothing to stop")),
    Row("teardown-bad-host", ["invoke", "teardown", "--run", "x", "--host", "user@"], says=("HOST='user@'",)),
    Row("stop-no-host", ["invoke", "stop", "--run", "seed-run"], says=("--host", "--local")),
    Row("stop-bad-run", ["invoke", "stop", "--run", "A B", "--local"], says=("run id",)),
    Row("logs-no-host", ["invoke", "logs", "--run", "seed-run"], says=("--host", "--local")),
    Row("logs-lines-abc", ["invoke", "logs", "--run", "seed-run", "--local", "--lines", "abc"], says=("--lines",)),
    Row("logs-local-no-log", ["invoke", "logs", "--run", "seed-run", "--local"],
        says=("logs/seed-run.log", "learner.log", "make gsm8k RUN=seed-run")),  # tail's own message before
    Row("logs-local-follow-no-log", ["invoke", "logs", "--run", "never-run", "--local", "--follow"],
        says=("logs/never-run.log", "make gsm8k RUN=never-run")),  # tail -F waited for it, saying tail's words
    # -- invoke: the retriever ----------------------------------------------------------------
    Row("retriever-port-abc", ["invoke", "retriever", "--port", "abc"], says=("--port",)),
    Row("retriever-build-no-out", ["invoke", "retriever.build"], says=("--out",)),
    Row("retriever-build-missing-corpus", ["invoke", "retriever.build", "--out", "{tmp}/idx", "--corpus",
                                           "/nonexistent.jsonl"], says=("/nonexistent.jsonl",)),
    Row("retriever-status-no-url", ["invoke", "retriever.status"], says=("DRL_RETRIEVER_URL",)),
    Row("retriever-status-bad-url", ["invoke", "retriever.status", "--url", "ftp://x"], says=("ftp://x",)),
    # -- nox sessions that take input ------------------------------------------------------------
    Row("nox-preflight-recipe", ["nox", "-s", "preflight", "--", "--recipe", "nosuch"], says=("nosuch",)),
    Row("nox-soak-trials", ["nox", "-s", "soak"], env={"DRL_SOAK_TRIALS": "abc"}, says=("DRL_SOAK_TRIALS",)),
    Row("nox-bench-unknown", ["nox", "-s", "bench", "--", "nosuch"], says=("nosuch",)),
    # without a GPU the GPU loop ran both parts into errors and reported success
    Row("nox-gpu-loop-no-gpu", ["nox", "-s", "gpu_loop", "--", "--parts", "learning", "--out", "{tmp}/g.json"],
        says=("needs a CUDA GPU",), without_cuda=True),
    # folders that are no slime / Megatron-LM checkouts: said before minutes of installs (torch first, before)
    Row("nox-slime-compat-not-checkouts", ["nox", "-s", "slime_compat", "--", "{tmp}", "{tmp}"],
        says=("is not a slime checkout",)),
    # -- python -m CLIs ----------------------------------------------------------------------
    Row("verify-missing-run", ["python", "-m", "worker_contract", "verify", "--run", "nope"], says=("nope",)),
    Row("verify-store-ftp", ["python", "-m", "worker_contract", "verify", "--run", "x", "--store", "ftp://x"],
        says=("ftp://x",)),
    Row("verify-half-r2env", ["python", "-m", "worker_contract", "verify", "--run", "x"], files=_r2env(HALF_R2ENV),
        says=("R2_BUCKET",)),
    Row("worker-no-run", ["python", "-m", "worker_contract.worker", "--store", "file:///tmp/x"], says=("DRL_RUN",)),
    Row("worker-dry-run-y", ["python", "-m", "worker_contract.worker", "--run", "x", "--store", "file:///tmp/x"],
        env={"DRL_DRY_RUN": "y"}, says=("DRL_DRY_RUN",)),
    Row("worker-store-ftp", ["python", "-m", "worker_contract.worker", "--run", "x", "--store", "ftp://x"],
        says=("ftp://x",)),
    Row("worker-batch-groups-0", ["python", "-m", "worker_contract.worker", "--run", "x", "--store", "file:///tmp/x",
                                  "--model", "/nonexistent", "--batch-groups", "0", "--wait", "1"],
        says=("batch_groups", "greater than or equal to 1"), never=("errors.pydantic.dev",)),
    Row("worker-retriever-tier", ["python", "-m", "worker_contract.worker", "--run", "x", "--store", "file:///tmp/x",
                                  "--model", "/nonexistent", "--retriever-tier", "huge", "--wait", "1"],
        says=("--retriever-tier='huge'", "light"), never=("errors.pydantic.dev",)),
    Row("worker-retriever-tier-env", ["python", "-m", "worker_contract.worker", "--run", "x", "--store",
                                      "file:///tmp/x", "--model", "/nonexistent", "--wait", "1"],
        env={"DRL_RETRIEVER_TIER": "big"}, says=("DRL_RETRIEVER_TIER='big'", "light"), never=("errors.pydantic.dev",)),
    Row("worker-retriever-url-ftp", ["python", "-m", "worker_contract.worker", "--run", "x", "--store",
                                     "file:///tmp/x", "--model", "/nonexistent", "--wait", "1"],
        env={"DRL_RETRIEVER_URL": "ftp://x"}, says=("DRL_RETRIEVER_URL='ftp://x'", "http(s)"),
        never=("errors.pydantic.dev",)),
    # numbers that mean nothing: one check per kind (worker_contract.cli.number, the recipe's pydantic bounds)
    Row("worker-groups-0", [*W[:-2], "--groups", "0"], says=("--groups", "at least 1")),
    Row("worker-threads-negative", [*W[:-2], "--threads", "-3"], says=("--threads", "at least 1")),
    Row("worker-threads-huge", [*W[:-2], "--threads", "99999"], says=("--threads", "at most")),
    Row("worker-wait-negative", [*W[:-2], "--wait", "-5"], says=("--wait", "above 0")),
    Row("worker-lag-beyond-staleness", [*W, "--lag-versions", "999"], bucket="",
        says=("--lag-versions 999", "staleness bound (3)")),
    Row("make-recipe-workers-0", ["make", "gsm8k", "RUN=x"], env=DRY, files={"runs/gsm8k.yaml": "workers: 0"},
        says=("embedded.workers",)),
    Row("make-recipe-workers-1000", ["make", "gsm8k", "RUN=x"], env=DRY, files={"runs/gsm8k.yaml": "workers: 1000"},
        says=("embedded.workers",)),
    Row("make-recipe-time-budget", ["make", "gsm8k", "RUN=x"], env=DRY,
        files={"runs/gsm8k.yaml": "time_budget_s: -1"}, says=("embedded.time_budget_s",)),
    Row("make-recipe-eval-problems", ["make", "gsm8k", "RUN=x"], env=DRY,
        files={"runs/gsm8k.yaml": "eval_problems: 0"}, says=("embedded.eval_problems",)),
    Row("retriever-cli-limit-0", ["python", "-m", "infra.retriever", "build", "--out", "{tmp}/idx", "--corpus",
                                  "x.jsonl", "--limit", "0"], says=("--limit", "at least 1")),
    Row("bench-staleness-budget", ["python", "-m", "bench.staleness", "--budget-s", "-1"], says=("--budget-s",)),
    # an output directory that is a file, or that cannot be made: one sentence (worker_contract.cli.output_dir)
    Row("plot-out-file", ["invoke", "plot", "--run", "seed-run", "--out", "{tmp}/afile"],
        files={"{tmp}/afile": ("mine", 0o644)}, says=("--out", "is a file")),
    Row("plot-out-unwritable", ["invoke", "plot", "--run", "seed-run", "--out", "/proc/stoa-plots"],
        says=("--out", "/proc/stoa-plots")),
    Row("convert-out-file-dry-run", ["python", "-m", "infra.convert", "/nonexistent", "--out", "{tmp}/afile",
                                     "--dry-run"], files={"{tmp}/afile": ("mine", 0o644)}, says=("--out", "a file")),
    Row("convert-cli-missing", ["python", "-m", "infra.convert", "/nonexistent", "--out", "{tmp}/o"],
        says=("/nonexistent",)),
    Row("retriever-cli-corpus", ["python", "-m", "infra.retriever", "build", "--out", "{tmp}/idx", "--corpus",
                                 "/nonexistent.jsonl"], says=("/nonexistent.jsonl",)),
    Row("preflight-cli-empty", ["python", "-m", "infra.preflight"], says=("DRL_DRY_RUN=1",)),
    Row("preflight-cli-profile", ["python", "-m", "infra.preflight", "--recipe", "gsm8k", "--run", "x",
                                  "--profile", "nope"], says=("--profile",)),
    Row("preflight-cli-top-p", ["python", "-m", "infra.preflight", "--recipe", "gsm8k", "--run", "x", "--store",
                                "file://{tmp}/bucket"], files={"runs/gsm8k.yaml": "top_p: 0.9"},
        says=("algo.top_p=0.9", "top_p: 1.0")),
    Row("boxops-bad-run", ["python", "-m", "infra.boxops", "stop", "--remote-dir", "{tmp}", "--run", "A B"],
        says=("run id",)),
    Row("boxops-no-yes", ["python", "-m", "infra.boxops", "teardown", "--remote-dir", ".", "--run", "seed-run",
                          "--purge"], says=("--yes",)),
    # a confirmed purge in a checkout: the run's own files go; the tree, .r2env and the other run stay
    Row("boxops-purge-own-run", ["python", "-m", "infra.boxops", "teardown", "--remote-dir", ".", "--run", "seed-run",
                                 "--purge", "--yes"], rc=0, lines=None, says=("keep",),
        may_change=(".stoa/runs/seed-run",)),
    Row("launch-gpu-missing", ["python", "-m", "infra.launch_gpu", "--recipe-json", "/nonexistent.json"],
        says=("/nonexistent.json",)),
    Row("patches-missing-tree", ["python", "-m", "infra.patches.apply", "--tree", "/nonexistent"],
        says=("/nonexistent",)),
    Row("bench-unknown", ["python", "-m", "bench", "nosuch"], says=("nosuch",)),
    Row("convert-cli-no-args", ["python", "-m", "infra.convert"], says=("--out",)),
    Row("learner-cli-no-args", ["python", "-m", "entrypoints.learner"], says=("--recipe-json",)),
    Row("learner-missing-recipe", ["python", "-m", "entrypoints.learner", "--recipe-json", "{tmp}/none.json",
                                   "--model-dir", "{tmp}", "--state-dir", ".stoa/runs/seed-run"], says=("none.json",)),
    Row("psqa-eval-no-args", ["python", "-m", "entrypoints.psqa_eval"], says=("--out",)),
    Row("retriever-cli-port", ["python", "-m", "infra.retriever", "serve", "--corpus", "x.jsonl", "--port", "99999"],
        says=("--port",)),
    Row("box-check-here", ["python", "-m", "infra.box_check", "--remote-dir", "{tmp}"], rc=1, lines=None,
        says=("box check",)),  # a check that fails on a machine without a GPU: exit 1, rows, no traceback
    Row("status-bad-contract", ["invoke", "status", "--run", "seed-run"], env={"DRL_N_SAMPLES": "8.0"},
        says=("DRL_N_SAMPLES='8.0'",)),
    # -- a published run, damaged the way anyone with the bucket's credentials could ------------------------
    Row("status-stats-not-object", ["invoke", "status", "--run", PUB], bucket="stats-list", rc=0, lines=None,
        says=("pub-run", "v11")),
    Row("status-stats-odd-fields", ["invoke", "status", "--run", PUB], bucket="stats-fields", rc=0, lines=None,
        says=("pub-run", "v11")),
    Row("status-pointer-garbage", ["invoke", "status", "--run", PUB], bucket="pointer-garbage", rc=0, lines=None,
        says=("current.json does not verify", "unreadable"), never=("no pointer yet",)),
    Row("status-stray-patch-key", ["invoke", "status", "--run", PUB], bucket="stray-patch", rc=0, lines=None,
        says=("pub-run", "v11")),
    # off a terminal (COLUMNS unset) the tables keep their width: no header or cell cut to "…"
    Row("status-piped-keeps-columns", ["bash", "-c", f"invoke status --run {PUB} | cat"], bucket="", rc=0, lines=None,
        env={"COLUMNS": ""}, says=("worker", "newest", "last seen", "dropped", "versions", "trained on (recent)"),
        never=("…",)),
    Row("verify-after-gc", ["bash", "-c", f"invoke gc --run {PUB} --yes >/dev/null && python -m worker_contract "
                            f"verify --run {PUB}"], bucket="", rc=0, lines=None, may_change=(".stoa/bucket",),
        says=("v1      ok   collected", "4 collected", ": OK"), never=("interrupted attempt",)),
    # a recipe that cannot resume the run is refused before a base is built or a retriever started (it built a
    # 5-minute base first)
    Row("make-psqa-on-another-tasks-run", ["make", "psqa", f"RUN={PUB}"], bucket="", says=("task", "arithmetic",
        "psqa"), lines=None, may_change=(f".stoa/runs/{PUB}",)),
    Row("verify-run-json-list", ["python", "-m", "worker_contract", "verify", "--run", PUB], bucket="run-json-list",
        says=("pub-run/run.json", "not a valid run manifest"), never=("validation error for",)),
    Row("joincard-run-json-list", ["invoke", "joincard", "--run", PUB], bucket="run-json-list",
        says=("pub-run/run.json", "not a valid run manifest"), never=("validation error for",)),
    Row("worker-run-json-list", W, bucket="run-json-list", says=("pub-run/run.json", "not a valid run manifest")),
    Row("worker-run-json-garbage", W, bucket="run-json-garbage", says=("pub-run/run.json", "not a valid run manifest"),
        never=("upgrade the worker",)),
    # a model directory whose config.json is no decoder LM's: the worker's identity refusal (exit 3, docs/mac-worker.md)
    Row("worker-config-no-sizes", [*W, "--model", "{tmp}/model"], bucket="", rc=3,
        files={"{tmp}/model/config.json": ('{"model_type": "qwen2"}', 0o644)},
        says=("config.json", "num_attention_heads")),
    Row("worker-config-list", [*W, "--model", "{tmp}/model"], bucket="", rc=3,
        files={"{tmp}/model/config.json": ("[]", 0o644)}, says=("config.json", "JSON object")),
    # -- files the user names ---------------------------------------------------------------------------
    Row("retriever-build-corpus-list", ["invoke", "retriever.build", "--out", "{tmp}/idx", "--corpus",
                                        "{tmp}/c.jsonl"], files={"{tmp}/c.jsonl": ('{"id": 1, "contents": "a b"}\n[1]\n',
                                                                                   0o644)},
        says=("c.jsonl:2", "not an object")),
    Row("retriever-build-corpus-not-json", ["invoke", "retriever.build", "--out", "{tmp}/idx", "--corpus",
                                            "{tmp}/c.jsonl"], files={"{tmp}/c.jsonl": ("title,abstract\n", 0o644)},
        says=("c.jsonl:1", "not JSON")),
    # megatron's torch_dist writer needs a CUDA build of torch; elsewhere convert refuses in a sentence (it imports
    # megatron-core and builds the model first: 6-12 s, so in the slow lane)
    Row("convert-without-cuda", ["invoke", "convert", "--hf-dir", "embedded/base_gsm8k", "--out", "{tmp}/out"],
        says=("CUDA build of torch", "GPU host"), without_cuda=True, slow=True),
    Row("preflight-plan-list", ["python", "-m", "infra.preflight"], stdin=PLAN.format("[1]"),
        says=("launch plan does not validate",), never=("errors.pydantic.dev",)),
    Row("preflight-plan-no-command", ["python", "-m", "infra.preflight"], stdin=PLAN.format('{"plan_version": 1}'),
        says=("command: Field required",), never=("errors.pydantic.dev",)),
    Row("launch-recipe-binary", [*L, "--run", "x"], env=DRY, files={"runs/gsm8k.yaml": (b"name: \xff\xfe\n", 0o644)},
        says=("gsm8k.yaml", "UTF-8")),
    Row("status-r2env-directory", ["invoke", "status", "--run", "seed-run"], files={".r2env": ("", None)},
        says=(".r2env is a directory",)),
    Row("verify-r2env-binary", ["python", "-m", "worker_contract", "verify", "--run", "x"],
        files={".r2env": (b"R2_BUCKET=\xff\xfe\n", 0o600)}, says=(".r2env is not UTF-8",)),
    Row("status-endpoint-bad-ipv6", ["invoke", "status", "--run", "seed-run", "--store", "s3://stoa-bucket"],
        env={**S3_ENV, "DRL_S3_ENDPOINT": "http://[::1"}, says=("DRL_S3_ENDPOINT='http://[::1'", "not a valid URL")),
    Row("verify-endpoint-bad-port", ["python", "-m", "worker_contract", "verify", "--run", "x", "--store",
                                     "s3://stoa-bucket"], env={**S3_ENV, "DRL_S3_ENDPOINT": "http://127.0.0.1:abc"},
        says=("DRL_S3_ENDPOINT='http://127.0.0.1:abc'", "not a valid URL")),
    # MODEL= whose config.json the run would refuse: the dry run refuses it too, naming the file
    Row("make-model-config-not-json", ["make", "gsm8k", "RUN=x", "MODEL={tmp}/model"], env=DRY,
        files={"{tmp}/model/config.json": ("{not json", 0o644)}, says=("config.json is not valid JSON",)),
    Row("launch-host-model-config-list", [*L, "--run", "x", "--host", "root@203.0.113.7", "--model", "{tmp}/model"],
        env={**DRY, **S3_ENV, "DRL_STORE": "s3://stoa-bucket"}, files={"{tmp}/model/config.json": ("[]", 0o644)},
        says=("config.json must hold a JSON object",)),
    # -- a recipe file of one's own ---------------------------------------------------------------------
    Row("launch-recipe-path", ["python", "-m", "entrypoints.launch", "--recipe", "{tmp}/my-recipe.yaml", "--run", "x"],
        rc=0, lines=None, env=DRY, files=MY_RECIPE, says=("staleness: 2", "mode: embedded")),
    Row("launch-recipe-path-invalid", ["python", "-m", "entrypoints.launch", "--recipe", "{tmp}/my-recipe.yaml",
                                       "--run", "x"], env=DRY, files=BAD_RECIPE,
        says=("my-recipe.yaml", "algo.staleness=-5")),
    Row("launch-recipe-path-missing", ["python", "-m", "entrypoints.launch", "--recipe", "{tmp}/none.yaml",
                                       "--run", "x"], env=DRY, says=("none.yaml", "does not exist")),
    Row("preflight-recipe-path", ["python", "-m", "infra.preflight", "--recipe", "{tmp}/my-recipe.yaml", "--run",
                                  "x", "--store", "file://{tmp}/bucket"], files=BAD_RECIPE, says=("algo.staleness=-5",)),
]


def _fill(argv: list[str], tmp: Path, fakepy: Path, clone_path: Path | None = None) -> list[str]:
    store = f"file://{clone_path / '.stoa' / 'bucket'}" if clone_path else "{store}"
    return [a.replace("{tmp}", str(tmp)).replace("{fakepy}", str(fakepy)).replace("{store}", store) for a in argv]


def _copy_working_tree(dst: Path) -> None:
    """The clone holds HEAD; bring it to this working tree (uncommitted edits, new files)."""
    diff = subprocess.run(["git", "-C", str(REPO), "diff", "HEAD", "--binary"], capture_output=True, check=True).stdout
    if diff:
        subprocess.run(["git", "-C", str(dst), "apply", "--binary", "-"], input=diff, check=True)
    others = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, others):
        if (REPO / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dst / rel)


class Clone:
    """The scratch clone, rebuilt when a row damaged it."""

    def __init__(self, root: Path):
        self.root = root
        self.path = root / "clone"
        self.dirty = True

    def ensure(self) -> Path:
        if self.dirty:
            shutil.rmtree(self.path, ignore_errors=True)
            subprocess.run(["git", "clone", "-q", str(REPO), str(self.path)], check=True)
            _copy_working_tree(self.path)
            self.reset_state()
            self.dirty = False
        return self.path

    def reset_state(self) -> None:
        p = self.path
        if not (p / ".venv").exists():
            (p / ".venv").symlink_to(VENV)
        old = 946684800  # 2000-01-01: setup's stamp is newer, so make never reinstalls
        os.utime(p / "pyproject.toml", (old, old))
        for rel, text in SEED_FILES.items():
            (p / rel).parent.mkdir(parents=True, exist_ok=True)
            (p / rel).write_text(text)
        (p / ".r2env").write_text(BASE_R2ENV)
        (p / ".r2env").chmod(0o600)


#: (path, inode, size, mtime, ctime) -> sha1 of the content: a file whose stat is unchanged is not read again
#: (any write moves ctime), so the two snapshots of a row read only what the row wrote
_DIGESTS: dict[tuple, str] = {}


def _digest(path: Path, st: os.stat_result) -> str:
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = hashlib.sha1(path.read_bytes()).hexdigest()
    return _DIGESTS[key]


def snapshot(root: Path) -> dict[str, str]:
    """Every path under the clone (caches and git's object store aside) -> its type, mode and content digest.
    A row takes two, so this walks with scandir (whose entries carry their type) and skips .git/objects whole."""
    out: dict[str, str] = {}

    def walk(path: str, rel: Path) -> None:
        if rel.parts[:2] == (".git", "objects"):
            return
        out[f"{rel}/"] = "dir"
        with os.scandir(path) as entries:
            for e in entries:
                name = rel / e.name
                if e.is_symlink():
                    out[str(name)] = f"link {os.readlink(e.path)}"
                elif e.is_dir():
                    if e.name not in IGNORED_DIRS:
                        walk(e.path, name)
                elif e.is_file():
                    st = e.stat()
                    out[str(name)] = f"{stat.S_IMODE(st.st_mode):o} {_digest(Path(e.path), st)}"

    walk(str(root), Path("."))
    return out


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    if not (VENV / "bin" / "python").exists():
        pytest.skip("no .venv (run `make setup`)")
    return Clone(tmp_path_factory.mktemp("bad-inputs"))


def _env(clone_path: Path, home: Path, extra: dict[str, str]) -> dict[str, str]:
    keep = ("LANG", "LC_ALL", "TMPDIR", "PIP_CONFIG_FILE")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(PATH=f"{clone_path / '.venv' / 'bin'}:/usr/local/bin:/usr/bin:/bin", HOME=str(home),
               DRL_NO_GPU="1", NO_COLOR="1", COLUMNS="200", TERM="dumb")
    env.update(extra)
    return env


def run_row(cmd: list[str], cwd: Path, env: dict[str, str], stdin: str) -> tuple[int, str]:
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(stdin.encode(), timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this row started, by its leader's PID
        out, _ = proc.communicate()
        return -9, out.decode(errors="replace") + f"\n[timed out after {TIMEOUT_S:.0f} s: the command did real work]"
    return proc.returncode, out.decode(errors="replace")


_NOISE = re.compile(r"^(make(\[\d+\])?: \*\*\*|make(\[\d+\])?: (Entering|Leaving)|nox > |usage: |\s)")


def message_lines(out: str) -> list[str]:
    """What the command said, less the tools' own framing (make's and nox's lines, argparse's usage above
    its error); a usage line that is the whole answer is the message."""
    lines = [line for line in out.splitlines() if line.strip() and not _NOISE.match(line)]
    return lines or [line for line in out.splitlines() if line.startswith("usage: ")]


def _apply_files(path: Path, files: dict, tmp: Path) -> dict[str, tuple[bytes, int] | None]:
    saved: dict[str, tuple[bytes, int] | None] = {}
    for rel, spec in files.items():
        rel = rel.replace("{tmp}", str(tmp))  # an absolute path outside the clone (a model, a corpus)
        target = path / rel
        saved[rel] = (target.read_bytes(), stat.S_IMODE(target.stat().st_mode)) if target.is_file() else None
        if spec is None:
            target.unlink(missing_ok=True)
        elif isinstance(spec, str):  # "key: value" replaces that key's line in a YAML file
            key = spec.split(":")[0]
            text = re.sub(rf"(?m)^(\s*){key}:.*$", rf"\g<1>{spec}", target.read_text(), count=1)
            target.write_text(text)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            if spec[1] is None:  # a directory where a file is expected
                target.unlink(missing_ok=True)
                target.mkdir()
                continue
            if isinstance(spec[0], bytes):
                target.write_bytes(spec[0])
            else:
                target.write_text(spec[0])
            target.chmod(spec[1])
    return saved


def _restore_files(path: Path, saved: dict[str, tuple[bytes, int] | None], tmp: Path) -> None:
    for rel, data in saved.items():
        target = path / rel
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        if data is None:
            target.unlink(missing_ok=True)
        else:  # content and mode: a row's .r2env at 0644 must not reach the next row
            target.write_bytes(data[0])
            target.chmod(data[1])
    shutil.rmtree(path / ".stoa" / "bucket", ignore_errors=True)


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """A file bucket holding run `pub-run` as the trainer publishes it (tests/opsbucket.py, the real writers):
    versions 1..11, anchors v1, v5, v9, stats, two workers' rollouts. Rows copy it; none writes here."""
    from opsbucket import build_run

    from worker_contract.store.file import FileStore

    root = tmp_path_factory.mktemp("published")
    build_run(FileStore(str(root)), PUB, pointer=11, anchor_interval=4, workers={"w1": [9, 10, 11], "w2": [10, 11]})
    return root


@functools.cache
def _has_cuda() -> bool:
    code = "import torch; print(torch.cuda.is_available())"
    return subprocess.run([str(VENV / "bin" / "python"), "-c", code], capture_output=True, text=True).stdout.strip() \
        == "True"


#: rows run this many at a time, each worker on its own clone (the rows are independent processes)
POOL = max(1, min(4, os.cpu_count() or 1))


@dataclass
class Outcome:
    problems: list[str]
    rc: int
    out: str


def run_one(row: Row, clone: Clone, tmp_path: Path, published: Path | None) -> Outcome:
    """Run one row in `clone` and say what is wrong with how the command answered."""
    path = clone.ensure()
    fakepy = tmp_path / "fakepy"  # records a call instead of installing anything
    fakepy.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'fakepy.log'}\n")
    fakepy.chmod(0o755)
    if row.bucket is not None:  # removed again with the rest of .stoa/bucket after the row
        shutil.copytree(published, path / ".stoa" / "bucket", dirs_exist_ok=True)
        BUCKET_DAMAGE[row.bucket](path / ".stoa" / "bucket" / PUB)
    saved = _apply_files(path, row.files, tmp_path)
    before = snapshot(path)
    home = tmp_path / "home"
    home.mkdir()
    try:
        rc, out = run_row(_fill(row.argv, tmp_path, fakepy, path), path, _env(path, home, row.env), row.stdin)
        after = snapshot(path)
    finally:
        _restore_files(path, saved, tmp_path)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)
                     and not any(k == p or k.startswith(p + "/") for p in row.may_change))
    if changed or not (path / ".git").is_dir():
        clone.dirty = True
    elif row.may_change:
        clone.reset_state()
    problems = []
    if "Traceback (most recent call last)" in out or "BrokenPipeError" in out:
        problems.append("a traceback")
    wanted = row.rc if isinstance(row.rc, tuple) else (row.rc,)
    if rc not in wanted:
        problems.append(f"exit status {rc}, documented {row.rc}")
    low = out.lower()
    problems += [f"no mention of {s!r}" for s in row.says if s.lower() not in low]
    problems += [f"mentions {s!r}" for s in row.never if s.lower() in low]
    problems += ["a secret in the output" for s in SECRETS if s in out]
    msg = message_lines(out)
    if row.lines is not None and rc != 0 and not 1 <= len(msg) <= row.lines:
        problems.append(f"{len(msg)} message lines, not one sentence")
    if changed:
        problems.append(f"changed the clone: {', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}")
    if (tmp_path / "fakepy.log").exists():
        problems.append("ran the venv's python before saying usage: " + (tmp_path / "fakepy.log").read_text()[:200])
    return Outcome(problems, rc, out)


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory, clone) -> dict[str, Outcome]:
    """Every row this session selected, run POOL at a time (worker i on clone i, rows in table order); each
    test then reads its row's outcome. A row whose harness failed says so as its problem."""
    import threading
    import traceback

    rows = [it.callspec.params["row"] for it in request.session.items
            if getattr(it, "originalname", None) == "test_bad_input" and it.module is request.module]
    rows = [r for r in rows if not (r.without_cuda and _has_cuda())]
    published = request.getfixturevalue("published") if any(r.bucket is not None for r in rows) else None
    clones = [clone] + [Clone(tmp_path_factory.mktemp(f"bad-inputs-{i}")) for i in range(1, POOL)]
    tmps = {r.id: tmp_path_factory.mktemp("row") for r in rows}
    results: dict[str, Outcome] = {}

    def work(i: int) -> None:
        for r in rows[i::POOL]:
            try:
                results[r.id] = run_one(r, clones[i], tmps[r.id], published)
            except Exception:
                clones[i].dirty = True
                results[r.id] = Outcome([f"the harness failed:\n{traceback.format_exc()}"], -1, "")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(POOL)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("row", [pytest.param(r, marks=[pytest.mark.slow] if r.slow else []) for r in ROWS],
                         ids=[r.id for r in ROWS])
def test_bad_input(row: Row, outcomes: dict[str, Outcome]) -> None:
    if row.without_cuda and _has_cuda():
        pytest.skip("torch has CUDA here: the command does its real work")
    o = outcomes[row.id]
    assert not o.problems, f"{row.id}: " + "; ".join(o.problems) + f"\n--- output (exit {o.rc}) ---\n{o.out[-3000:]}"


def test_run_main_sorts_how_a_command_ended(capsys) -> None:
    """worker_contract.cli.run_main: bad input 2 in one line, our bug 70 with its traceback and where to report."""
    from worker_contract.cli import EXIT_BAD_INPUT, EXIT_BUG, run_main

    def bad_input():
        raise ValueError("--lines='x' must be an integer >= 1")

    def bug():
        raise KeyError("a bug of ours")

    assert run_main(bad_input, "prog") == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err == "prog: --lines='x' must be an integer >= 1\n"
    assert run_main(bug, "prog") == EXIT_BUG
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "this is a bug in stoa trainer" in err and "report" in err
    assert run_main(lambda: 1, "prog") == 1 and run_main(lambda: None, "prog") == 0
    # a dependency this Python lacks (the command run outside the venv): one line, where to run it (it was our
    # traceback, then a second one from the bug report importing what was missing); a module of ours is a bug

    def outside_the_venv():
        import blake3_not_installed_here  # noqa: F401

    def ours_missing():
        import trainer.no_such_module  # noqa: F401

    assert run_main(outside_the_venv, "prog") == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "lacks 'blake3_not_installed_here'" in err and len(err.splitlines()) == 1, err
    # this suite runs in the project's venv: the fix is an install into it, not "use the venv"
    assert sys.prefix != sys.base_prefix and f"install it into this venv ({sys.prefix})" in err, err
    assert run_main(ours_missing, "prog") == EXIT_BUG
    assert "this is a bug in stoa trainer" in capsys.readouterr().err
    # a closed pipe (141, quiet) is checked through a real pipe: the launch-broken-pipe row


def test_short_flags_have_one_meaning(clone: Clone, tmp_path: Path) -> None:
    """Across every Invoke task: a short flag means one thing, -v is --verbose, --reveal has no short flag."""
    path = clone.ensure()
    env = _env(path, tmp_path, {})
    code = ("import json, tasks\n"
            "out = {}\n"
            "def walk(coll, prefix=''):\n"
            "    for name, t in coll.tasks.items():\n"
            "        out[prefix + name] = [sorted(a.names) for a in t.get_arguments()]\n"
            "    for cname, c in coll.collections.items():\n"
            "        walk(c, prefix + cname + '.')\n"
            "walk(tasks.ns)\n"
            "print(json.dumps(out))\n")
    res = subprocess.run([str(path / ".venv" / "bin" / "python"), "-c", code], cwd=path, env=env,
                         capture_output=True, text=True, check=True)
    import json

    meanings: dict[str, set[str]] = {}
    for task, args in json.loads(res.stdout.strip().splitlines()[-1]).items():
        for names in args:
            shorts = [n for n in names if len(n) == 1]
            longs = [n for n in names if len(n) > 1]
            for s in shorts:
                meanings.setdefault(s, set()).update(longs)
            assert not (shorts and any(n == "reveal" for n in longs)), f"{task}: --reveal has a short flag"
    several = {s: sorted(m) for s, m in meanings.items() if len(m) > 1}
    assert not several, f"short flags with several meanings across tasks: {several}"
    assert meanings.get("v", {"verbose"}) == {"verbose"}, f"-v means {meanings['v']}, not --verbose"

