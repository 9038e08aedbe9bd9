"""Secrets: the user-facing commands run as real processes, in a copy of the repository whose `.r2env`
(mode 0600) holds known fake R2 credentials, with fake AWS credentials in the environment too, against a
bucket on the loopback S3 server that those credentials really sign requests to. Every stdout and stderr,
and every file the commands wrote (logs, run directories, the home directory), is scanned for the values.

Commands: the launcher's dry runs (embedded, remote GPU box, fleet), preflight reading a dry run,
`invoke joincard` (three formats), `invoke status` (table and JSON), `invoke gc --dry-run`,
`python -m worker_contract verify`, a pytest run of the S3 store tests with DEBUG logs captured, and (slow
lane) a short embedded run whose learner and worker processes inherit the environment.
Positive controls show the scan can fail: the `.r2env` itself, and `joincard --reveal`, hold the values.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from io import BytesIO
from pathlib import Path

import pytest
import torch
from conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY
from learner_fixtures import manifest

REPO = Path(__file__).resolve().parent.parent
ACCESS = "AKIASCANFAKE7Q2W9E4R"
SECRET = "scanFake+Secret/Value_0123456789abcdefXYZ"
AWS_ACCESS = "AKIAAWSFAKESCAN55555"
AWS_SECRET = "awsFake/scan+Secret_9876543210zyxwvuQ"
VALUES = (ACCESS, SECRET, AWS_ACCESS, AWS_SECRET)
RUN = "scan-run"


def repo_copy(dst: Path) -> Path:
    """The committed tree (git archive HEAD), so the commands read this copy's `.r2env`, not the checkout's."""
    try:
        blob = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True, timeout=120).stdout
        with tarfile.open(fileobj=BytesIO(blob)) as tar:
            tar.extractall(dst, filter="data")
    except (OSError, subprocess.SubprocessError):  # not a git checkout: copy the tree itself
        shutil.copytree(REPO, dst, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".git", ".venv", ".stoa", ".nox", "__pycache__", ".r2env"))
    return dst


class Scan:
    """Runs commands in the copy and collects everything they print."""

    def __init__(self, root: Path, home: Path, env: dict[str, str]):
        self.root, self.home, self.env = root, home, env
        self.outputs: dict[str, str] = {}
        self.started = time.time()

    def run(self, name: str, argv: list[str], *, stdin: str | None = None, env: dict | None = None,
            ok: tuple[int, ...] = (0,), timeout: float = 300) -> subprocess.CompletedProcess:
        p = subprocess.run(argv, cwd=self.root, env={**self.env, **(env or {})}, input=stdin, capture_output=True,
                           text=True, timeout=timeout)
        self.outputs[name] = p.stdout + "\n" + p.stderr
        assert p.returncode in ok, f"{name}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p

    def files(self) -> dict[str, bytes]:
        """Every file written since the scan began, under the copy and the home directory."""
        out = {}
        for base in (self.root, self.home):
            for path in base.rglob("*"):
                try:
                    if path.is_file() and not path.is_symlink() and path.stat().st_mtime >= self.started - 1:
                        out[str(path)] = path.read_bytes()
                except OSError:
                    continue
        return out

    def leaks(self, values=VALUES, skip: tuple[str, ...] = (".r2env",)) -> list[str]:
        found = [f"output of {name}: {v[:6]}..." for name, text in self.outputs.items() for v in values if v in text]
        for path, data in self.files().items():
            if path.endswith(skip):
                continue
            found += [f"file {path}: {v[:6]}..." for v in values if v.encode() in data]
        return found


@pytest.fixture
def scan(tmp_path, moto_server):
    from trainer.publish.publisher import Publisher
    from worker_contract.manifest import create_or_resume
    from worker_contract.signing import generate_private_key
    from worker_contract.store.s3 import S3Store

    root = repo_copy(tmp_path / "repo")
    home = tmp_path / "home"
    home.mkdir()
    bucket = moto_server.new_bucket()
    r2env = root / ".r2env"
    r2env.write_text(f"R2_ACCOUNT_ID=0123456789abcdef0123456789abcdef\nR2_ACCESS_KEY_ID={ACCESS}\n"
                     f"R2_SECRET_ACCESS_KEY={SECRET}\nR2_BUCKET={bucket}\nDRL_STORE=s3://{bucket}\n"
                     f"DRL_S3_ENDPOINT={moto_server.endpoint}\n")
    os.chmod(r2env, 0o600)
    # the run the read-only commands look at, published with the same fake credentials (moto checks none)
    store = S3Store.from_url(f"s3://{bucket}", {"DRL_S3_ENDPOINT": moto_server.endpoint,
                                                "R2_ACCESS_KEY_ID": ACCESS, "R2_SECRET_ACCESS_KEY": SECRET})
    key = generate_private_key()
    man = create_or_resume(store, manifest(RUN, key), resume=False)
    pub = Publisher(store, man, key, anchor_interval=2, progress=False)
    state = {"model.w.weight": torch.randn(16, 16)}
    for _ in range(3):
        pub.publish(state)
        state["model.w.weight"][0] += 1
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("R2_", "DRL_", "AWS_"))}
    env = {**base_env, "HOME": str(home), "PYTHONPATH": str(root), "AWS_ACCESS_KEY_ID": AWS_ACCESS,
           "AWS_SECRET_ACCESS_KEY": AWS_SECRET, "AWS_REGION": "us-east-1", "DRL_NO_GPU": "1"}
    return Scan(root, home, env), bucket


@pytest.mark.slow
@pytest.mark.integration
def test_no_credential_value_in_any_command_output_or_file(scan, moto_server):
    scan, bucket = scan
    py, inv = sys.executable, str(Path(sys.executable).parent / "invoke")
    dry = {"DRL_DRY_RUN": "1"}
    embedded = scan.run("dry run (embedded)", [py, "-m", "entrypoints.launch", "--recipe", "gsm8k", "--run", RUN], env=dry)
    assert "DRL_DRY_RUN=1" in embedded.stdout and "R2_SECRET_ACCESS_KEY=**********" in embedded.stdout
    remote = scan.run("dry run (remote)", [py, "-m", "entrypoints.launch", "--recipe", "gsm8k", "--run", RUN,
                                           "--host", "trainer@127.0.0.1"], env=dry)
    scan.run("dry run (fleet)", [py, "-m", "entrypoints.launch", "--recipe", "psqa", "--run", RUN,
                                 "--host", "trainer@127.0.0.1"], env=dry)
    scan.run("preflight", [py, "-m", "infra.preflight", "--profile", "quickstart"], stdin=remote.stdout, ok=(0, 1))
    scan.run("invoke preflight", [inv, "preflight", "--recipe", "gsm8k", "--run", RUN], ok=(0, 1))
    for fmt in ("text", "env", "json"):
        scan.run(f"joincard {fmt}", [inv, "joincard", "--run", RUN, "--format", fmt])
    scan.run("status", [inv, "status", "--run", RUN])
    scan.run("status json", [inv, "status", "--run", RUN, "--json"])
    scan.run("gc dry run", [inv, "gc", "--run", RUN, "--dry-run"])
    scan.run("verify", [py, "-m", "worker_contract", "verify", "--store", f"s3://{bucket}", "--run", RUN],
             env={"DRL_S3_ENDPOINT": moto_server.endpoint, "R2_ACCESS_KEY_ID": ACCESS, "R2_SECRET_ACCESS_KEY": SECRET})
    # the test suite's own logs: the S3 store tests with botocore's DEBUG wire log captured and shown. All but
    # the 2500-key listing, whose 2500 PUTs log the request every other test logs (27 MB of it, 30 s of a core
    # against 4 s for the rest); its paged listing's requests are the start_after listing test's
    junit = scan.root / "junit.xml"
    scan.run("pytest logs", [py, "-m", "pytest", "tests/test_store.py", "-k", "s3 and not 2500_keys", "-q", "-rA",
                             "-p", "no:cacheprovider", "--log-level=DEBUG", f"--junitxml={junit}"], timeout=600)
    assert "botocore" in scan.outputs["pytest logs"]  # the wire log was really captured
    assert "PASSED tests/test_store.py::test_list_order_prefix_start_after[s3]" in scan.outputs["pytest logs"]

    leaks = scan.leaks()
    assert leaks == [], leaks
    assert scan.leaks(values=(TEST_ACCESS_KEY, TEST_SECRET_KEY)) == []  # the moto test credentials too
    # positive controls: the scan finds a value in an output and in a file when one is there
    scan.run("joincard reveal", [inv, "joincard", "--run", RUN, "--format", "json", "--reveal"])
    (scan.home / "careless.log").write_text(f"oops {AWS_SECRET}\n")
    found = scan.leaks()
    assert any("joincard reveal" in f for f in found) and any("careless.log" in f for f in found), found


@pytest.mark.slow
@pytest.mark.integration
def test_no_credential_value_in_an_embedded_runs_logs(scan):
    """A short embedded run (learner and two workers as processes that inherit the environment, which
    holds the credentials): nothing under .stoa/ or in its output carries a value."""
    scan, _ = scan
    over = ["contract.n_samples=4", "algo.max_new_tokens=16", "algo.groups_per_step=2", "train.save_interval=2",
            "embedded.max_steps=2", "embedded.eval_every=2", "embedded.eval_problems=10",
            "embedded.base.hidden_size=32", "embedded.base.num_layers=1", "embedded.base.num_heads=2",
            "embedded.base.num_kv_heads=1", "embedded.base.intermediate_size=64", "embedded.base.sft_steps=10",
            "embedded.base.tokenizer_corpus=200", "embedded.base.vocab_size=300"]
    code = ("import sys\nfrom rich.console import Console\nfrom embedded.config import resolve_embedded\n"
            "from embedded.run import run_embedded\n"
            "over = dict(kv.split('=', 1) for kv in sys.argv[1:])\n"
            "over = {k: (int(v) if v.isdigit() else v) for k, v in over.items()}\n"
            "cfg = resolve_embedded('gsm8k', env={}, overrides={'run': 'scan-embedded', **over})\n"
            "sys.exit(run_embedded(cfg, console=Console(width=140)))\n")
    scan.run("embedded run", [sys.executable, "-c", code, *over],
             env={"R2_ACCESS_KEY_ID": ACCESS, "R2_SECRET_ACCESS_KEY": SECRET}, timeout=900)
    logs = [p for p in scan.files() if p.endswith(".log")]
    assert logs, "the embedded run wrote no logs: nothing was scanned"
    leaks = scan.leaks()
    assert leaks == [], leaks
