"""infra/remote over a real sshd on 127.0.0.1 (key-only, own port): deploy, credentials 0600, idempotent
redeploy, a failing remote step reported with its stderr, and the detached trainer's status/logs/stop.

The GPU-only steps (the on-box launch: download, convert, patch slime, Ray, train.py) need a CUDA box with
the slime image; here they are skipped with a message, never faked.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sshd import sshd_server  # noqa: F401  (fixture)

from infra import boxops
from infra.remote import deploy, launch_remote, logs, parse_host, remote_status, stop, teardown
from infra.remote.ssh import RemoteStepError, connect, run
from trainer.config import REPO_ROOT, resolve

pytestmark = pytest.mark.integration
SECRET = "sk-test-SECRET-9f8e7d6c5b4a"
CREDS = {"R2_ACCOUNT_ID": "acct0123", "R2_ACCESS_KEY_ID": "AKIDTESTVALUE42", "R2_SECRET_ACCESS_KEY": SECRET,
         "R2_BUCKET": "stoa-test"}


def make_repo(root: Path) -> Path:
    """A small trainer-side tree with things that must not travel (.venv, .stoa, .git, .r2env, bytecode)."""
    (root / "trainer").mkdir(parents=True)
    (root / "trainer/a.py").write_text("A = 1\n")
    (root / "trainer/b.py").write_text("B = 2\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    for junk in (".venv/lib/x.py", ".stoa/bucket/y", ".git/HEAD", "trainer/__pycache__/a.cpython-311.pyc"):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_text("junk\n")
    fd = os.open(root / ".r2env", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, "".join(f"{k}={v}\n" for k, v in CREDS.items()).encode())
    os.close(fd)
    (root / "pyproject.toml").write_text((REPO_ROOT / "pyproject.toml").read_text())
    return root


def test_parse_host():
    spec = parse_host("root@203.0.113.7:2222")
    assert (spec.user, spec.hostname, spec.port) == ("root", "203.0.113.7", 2222)
    assert parse_host("gpu-box").user is None
    for bad in ("", "root@", "root@box:99999", "a b@c", "root@box;rm -rf /"):
        with pytest.raises(ValueError, match="HOST="):
            parse_host(bad)


def test_tree_leaves_venv_state_git_and_credentials_home(tmp_path):
    tb = deploy.build_tarball(make_repo(tmp_path / "repo"))
    assert tb.files == ["pyproject.toml", "run.sh", "trainer/a.py", "trainer/b.py"]
    assert deploy.build_tarball(tmp_path / "repo").digest == tb.digest  # reproducible: idempotent shipping
    real = deploy.tree_files(REPO_ROOT)
    assert "trainer/config.py" in real and "infra/launch_gpu.py" in real
    assert not [f for f in real if f.startswith((".venv/", ".git/", ".stoa/")) or f.endswith(".r2env")]


def test_only_tracked_files_travel_and_never_a_secret_name(tmp_path):
    """In a git checkout only what git tracks is shipped: a card.env written by joincard, an SSH key, a .env
    and cloud credentials dropped in the tree stay home, and a secret-like name stays home even when tracked
    (a key committed by mistake); the .example templates travel."""
    root = make_repo(tmp_path / "repo")
    shutil.rmtree(root / ".git")
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=root,  # noqa: E731
                                    check=True, capture_output=True)
    git("init", "-q")
    for name in ("keys/id_ed25519", "prod.env", ".r2env.example", "runs/launch_fleet.env.example"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x\n")
    git("add", "pyproject.toml", "run.sh", "trainer/a.py", "trainer/b.py", "keys/id_ed25519", "prod.env",
        ".r2env.example", "runs/launch_fleet.env.example")
    git("commit", "-q", "-m", "tree")
    for name in ("card.env", "id_ed25519", ".env", "credentials.json", "notes.txt", "trainer/new.py"):
        (root / name).write_text("SECRET\n")
    files = deploy.tree_files(root)
    assert files == [".r2env.example", "pyproject.toml", "run.sh", "runs/launch_fleet.env.example", "trainer/a.py",
                     "trainer/b.py"]
    assert deploy.build_tarball(root).files == files


def _modes_watch(paths: list[Path], stop_evt: threading.Event, seen: list[str]) -> None:
    while not stop_evt.is_set():
        for p in paths:
            try:
                mode = stat.S_IMODE(os.stat(p).st_mode)
            except OSError:
                continue
            if mode & 0o077:
                seen.append(f"{p.name} {mode:o}")
        time.sleep(0.0002)  # poll fast, but leave the GIL to the SSH threads


def test_deploy_over_ssh_is_idempotent_and_credentials_are_0600(sshd_server, tmp_path):  # noqa: F811
    repo = make_repo(tmp_path / "repo")
    remote = tmp_path / "box" / "dRL"
    with connect(sshd_server.host, str(sshd_server.client_key)) as conn:
        first = deploy.ship_tree(conn, repo, str(remote))
        assert "4 files" in first
        assert (remote / "trainer/a.py").read_text() == "A = 1\n"
        assert os.access(remote / "run.sh", os.X_OK)
        for absent in (".venv", ".stoa", ".git", ".r2env", "trainer/__pycache__"):
            assert not (remote / absent).exists(), absent
        assert "unchanged" in deploy.ship_tree(conn, repo, str(remote))

        (repo / "trainer/b.py").unlink()
        (repo / "trainer/a.py").write_text("A = 3\n")
        assert "3 files" in deploy.ship_tree(conn, repo, str(remote))
        assert not (remote / "trainer/b.py").exists()
        assert (remote / "trainer/a.py").read_text() == "A = 3\n"

        seen: list[str] = []
        halt = threading.Event()
        watcher = threading.Thread(target=_modes_watch, args=([remote / ".r2env", remote / ".r2env.partial"], halt, seen))
        watcher.start()
        try:
            msg = deploy.ship_credentials(conn, str(remote), CREDS)
            again = deploy.ship_credentials(conn, str(remote), CREDS)
            changed = deploy.ship_credentials(conn, str(remote), {**CREDS, "R2_BUCKET": "other-bucket"})
        finally:
            halt.set()
            watcher.join()
        assert not seen, f"credentials were readable by others at some instant: {seen}"
        assert stat.S_IMODE((remote / ".r2env").stat().st_mode) == 0o600
        assert "R2_BUCKET=other-bucket" in (remote / ".r2env").read_text()
        assert "unchanged" in again and "unchanged" not in changed
        assert SECRET not in msg + again + changed

        from worker_contract.env import read_env_file  # the box side reads it back (refuses a non-0600 file)

        assert read_env_file(remote / ".r2env")["R2_SECRET_ACCESS_KEY"] == SECRET
        assert deploy.install_deps(conn, str(remote), repo, python=sys.executable) == "all present"


def test_failing_remote_step_is_reported_with_its_stderr(sshd_server):  # noqa: F811
    with connect(sshd_server.host, str(sshd_server.client_key)) as conn:
        with pytest.raises(RemoteStepError) as e:
            run(conn, "demo_step", "echo 'disk on fire' >&2; exit 3")
    assert e.value.exited == 3 and e.value.step == "demo_step"
    assert "disk on fire" in str(e.value) and "step demo_step failed (exit 3)" in str(e.value)


def test_launch_remote_stops_at_check_box_with_remote_stderr(sshd_server, tmp_path, monkeypatch):  # noqa: F811
    """On this GPU-less host the box check fails: the launch reports it with the box's own stderr and ships
    nothing (the tree and the credentials only travel to a box that passed the check)."""
    if shutil.which("nvidia-smi"):
        pytest.skip("this host has a GPU driver: the check_box failure path cannot be shown here")
    for var in CREDS:
        monkeypatch.delenv(var, raising=False)
    repo = make_repo(tmp_path / "repo")
    remote = tmp_path / "box" / "dRL"
    cfg = resolve("gsm8k", env={"DRL_RUN": "remote-test-1"})
    lines: list[str] = []
    rc = launch_remote(cfg, host=sshd_server.host, ssh_key=str(sshd_server.client_key), remote_dir=str(remote),
                       out=lines.append, repo_root=repo)
    text = "\n".join(lines)
    assert rc == 1
    assert "[1/7] connect: connected" in text
    assert "check_box FAILED" in text and "nvidia-smi: not found" in text and "remote stderr" in text
    assert not remote.exists() or not any(remote.iterdir())
    assert SECRET not in text and CREDS["R2_ACCESS_KEY_ID"] not in text


def test_launch_remote_refuses_without_bucket_credentials(tmp_path, monkeypatch, capsys):
    for var in CREDS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("DRL_STORE", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    lines: list[str] = []
    cfg = resolve("gsm8k", env={"DRL_RUN": "remote-test-2"})
    assert launch_remote(cfg, host="root@127.0.0.1:1", out=lines.append, repo_root=repo) == 2
    err = capsys.readouterr().err
    assert "R2_ACCOUNT_ID" in err and "docs/r2-setup.md" in err and lines == []
    # the dry run prints its plan on stdout, which `| nox -s preflight` reads, and the refusal on stderr, where
    # the terminal shows it (on stdout it went into the pipe, and the terminal showed only make's Error 2)
    assert launch_remote(cfg, host="root@127.0.0.1:1", out=lines.append, repo_root=repo, dry_run=True) == 2
    assert "R2_ACCOUNT_ID" in capsys.readouterr().err and not any("R2_ACCOUNT_ID" in line for line in lines)
    assert "BEGIN" in lines[0]


def test_detached_trainer_survives_the_session_and_stops_by_pid(sshd_server, tmp_path):  # noqa: F811
    """Start a stand-in trainer process detached over SSH, close the session, then status/logs/stop."""
    remote = tmp_path / "box" / "dRL"
    host, key, py = sshd_server.host, str(sshd_server.client_key), sys.executable
    run_id = "detach-test"
    with connect(host, key) as conn:
        deploy.ship_tree(conn, REPO_ROOT, str(remote))
        deploy.ship_credentials(conn, str(remote), CREDS)
        paths = f"BoxPaths(remote_dir={str(remote)!r}, run={run_id!r})"
        script = ("from infra.boxops import start_detached; from infra.slime_launch import BoxPaths; "
                  f"p = {paths}; import sys; "
                  "print(start_detached([sys.executable, '-c', \"import time; print('trainer step 1', flush=True); "
                  "time.sleep(300)\"], log_file=p.log_file, pid_file=p.pid_file))")
        pid = int(run(conn, "start", f"cd {shlex.quote(str(remote))} && {py} -c {shlex.quote(script)}").stdout.strip())
    try:
        time.sleep(0.5)
        st = remote_status(host, run_id, ssh_key=key, remote_dir=str(remote), python=py)
        assert st["alive"] is True and st["pid"] == pid
        assert "trainer step 1" in st["log_tail"]
        assert st["gpu"]["ok"] is False and "nvidia-smi" in st["gpu"]["error"]
        assert logs(host, run_id, ssh_key=key, remote_dir=str(remote), lines=5) == 0

        dry = stop(host, run_id, ssh_key=key, remote_dir=str(remote), dry_run=True, python=py)
        assert dry["stopped"] is False and boxops._proc_start(pid) is not None
        out = stop(host, run_id, ssh_key=key, remote_dir=str(remote), python=py)
        assert out["stopped"] is True and out["pid"] == pid
        assert boxops._proc_start(pid) is None  # gone (or a zombie awaiting init)
        assert remote_status(host, run_id, ssh_key=key, remote_dir=str(remote), python=py)["alive"] is False

        td = teardown(host, run_id, ssh_key=key, remote_dir=str(remote), dry_run=True, python=py)
        assert td["dry_run"] and (remote / ".r2env").exists()
        teardown(host, run_id, ssh_key=key, remote_dir=str(remote), python=py)
        assert not (remote / ".r2env").exists() and (remote / "trainer").exists()
    finally:
        if boxops._proc_start(pid) is not None:  # the test started it; end it by PID if stop did not
            os.killpg(pid, 9)


def test_status_of_a_box_without_the_tree(sshd_server, tmp_path):  # noqa: F811
    st = remote_status(sshd_server.host, "nothing-here", ssh_key=str(sshd_server.client_key),
                       remote_dir=str(tmp_path / "empty"))
    assert st["deployed"] is False and st["alive"] is False and st["error"]


@pytest.mark.gpu
def test_gpu_box_check_passes_over_ssh(sshd_server, tmp_path):  # noqa: F811
    """On a GPU box with the slime image the box check passes over SSH; elsewhere it is skipped."""
    if not shutil.which("nvidia-smi") or not Path("/root/slime").is_dir():
        pytest.skip("needs a CUDA GPU box with the slime image (/root/slime); the on-box launch steps "
                    "(download, convert, patch, publish, Ray, train.py) run there via `make gsm8k HOST=...`")
    with connect(sshd_server.host, str(sshd_server.client_key)) as conn:
        assert "driver" in deploy.check_box(conn, remote_dir=str(tmp_path), slime_dir="/root/slime",
                                            megatron_dir="/root/Megatron-LM", min_free_gb=0, python=sys.executable)


def test_task_flags_are_frozen():
    """The task flags are tested; a new knob belongs in the recipe, not here."""
    from infra import remote_tasks

    common = {"run", "host", "local", "ssh_key", "remote_dir"}
    flags = {t.name: {a.name for a in t.get_arguments()} for t in (remote_tasks.logs, remote_tasks.stop,
                                                                    remote_tasks.teardown)}
    assert flags == {"logs": common | {"lines", "follow"}, "stop": common | {"dry_run", "yes"},
                     "teardown": common | {"purge", "dry_run", "yes"}}


def test_invoke_stop_and_teardown_dry_run_on_this_box(tmp_path):
    """`invoke stop/teardown --local --dry-run` act on this checkout and change nothing; without --host or
    --local they refuse (a forgotten --host never makes this checkout the box)."""
    import subprocess

    invoke = Path(sys.executable).with_name("invoke")
    for task in ("stop", "teardown"):
        res = subprocess.run([str(invoke), task, "--run", "no-such-run-xyz", "--local", "--dry-run"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert '"run": "no-such-run-xyz"' in res.stdout
        # stop logs the box's own dry-run lines; teardown prints its plan, marked as a dry run
        assert ("dry run" in res.stderr) if task == "stop" else ('"dry_run": true' in res.stdout)
        if task == "stop":  # a run that is not running is said so, not "would stop Ray jobs none ..."
            assert "nothing of run no-such-run-xyz is running here: nothing to stop" in res.stderr, res.stderr
        res = subprocess.run([str(invoke), task, "--run", "no-such-run-xyz", "--dry-run"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and "--local" in res.stderr
    # nothing to stop: said, with no question asked (stdin is closed here: a question would fail)
    res = subprocess.run([str(invoke), "stop", "--run", "no-such-run-xyz", "--local"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 0 and "nothing of run no-such-run-xyz is running on this machine" in res.stdout, res
    res = subprocess.run([str(invoke), "stop", "--run", "Bad Run", "--local", "--dry-run"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "DRL_RUN='Bad Run' is not a valid run id" in res.stderr
    assert not (REPO_ROOT / ".stoa" / "runs" / "no-such-run-xyz").exists()


def test_stop_does_not_say_nothing_runs_when_rays_jobs_are_unknown(tmp_path):
    """Something answers on Ray's dashboard port but lists no jobs (a dashboard that hangs, another program):
    the run's Ray jobs are unknown, so `stop` must not say that nothing of the run is running."""
    import socket
    import threading

    from infra import boxops

    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the port may still hold a closed connection
    try:
        srv.bind(("127.0.0.1", 8265))
    except OSError:
        srv.close()
        pytest.skip("port 8265 is taken (a Ray dashboard here)")
    srv.listen(8)
    stop = threading.Event()

    def serve(conn):  # HTTP 500 to each request, until the client hangs up (it closes first: no TIME_WAIT here)
        with conn:
            conn.settimeout(5)
            try:
                while data := conn.recv(65536):
                    if b"\r\n\r\n" in data:
                        conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n"
                                     b"Connection: close\r\n\r\n")
            except OSError:
                pass

    def answer_and_hang_up():  # a peer that answers every request with an error: Ray's job client lists nothing
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn = srv.accept()[0]
            except OSError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    t = threading.Thread(target=answer_and_hang_up, daemon=True)
    t.start()
    said: list[str] = []
    try:
        out = boxops.stop(str(tmp_path), "quiet-run", dry_run=True, log=said.append)
    finally:
        stop.set()
        t.join(timeout=5)
        srv.close()
    assert out["ray_jobs_listed"] is False and out["ray_jobs"] == [], (out, said)
    assert not any("nothing to stop" in line for line in said), said
    assert any("could not be listed" in line for line in said), said


def test_on_box_launch_stops_at_check_box_here(monkeypatch):
    """`make gsm8k` on a box without a GPU stops at the first step and reports why, changing nothing."""
    if shutil.which("nvidia-smi"):
        pytest.skip("this host has a GPU driver")
    from infra.launch_gpu import launch_on_this_box

    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    lines: list[str] = []
    cfg = resolve("gsm8k", env={"DRL_RUN": "box-test-1"}, overrides={"train.engine": "slime"})  # its 8 steps
    assert launch_on_this_box(cfg, out=lines.append) == 1
    text = "\n".join(lines)
    assert "[1/8] check_box FAILED" in text and "nvidia-smi: not found" in text
    assert "[2/8]" not in text and not (REPO_ROOT / ".stoa" / "runs" / "box-test-1").exists()
    assert SECRET not in text


def test_box_launch_over_ssh_reaches_the_on_box_sequence(sshd_server, tmp_path):  # noqa: F811
    """After the remote steps, `python3 -m infra.launch_gpu` runs on the box (the same sequence as `make
    gsm8k` there); on this GPU-less host its first step fails and the box's stderr comes back."""
    if shutil.which("nvidia-smi"):
        pytest.skip("this host has a GPU driver")
    from infra.slime_launch import BoxPaths

    remote = tmp_path / "box" / "dRL"
    cfg = resolve("gsm8k", env={"DRL_RUN": "box-ssh-1"}, overrides={"train.engine": "slime"}).model_copy(
        update={"store": "r2://stoa-test"})  # the slime engine's 8 on-box steps (native: test_native_launch.py)
    paths = BoxPaths(remote_dir=str(remote), run="box-ssh-1")
    with connect(sshd_server.host, str(sshd_server.client_key)) as conn:
        deploy.ship_tree(conn, REPO_ROOT, str(remote))
        deploy.ship_credentials(conn, str(remote), CREDS)
        deploy.write_recipe(conn, str(remote), paths.recipe_file, cfg.model_dump_json())
        with pytest.raises(RemoteStepError) as e:
            run(conn, "box_launch", f"cd {shlex.quote(str(remote))} && {sys.executable} -m infra.launch_gpu "
                                    f"--recipe-json {shlex.quote(paths.recipe_file)}")
    assert e.value.exited == 1
    assert "[1/8] check_box FAILED" in e.value.stderr and "nvidia-smi: not found" in e.value.stderr
    assert "[1/8] check_box ..." in e.value.stdout
    assert SECRET not in e.value.stdout + e.value.stderr


def test_teardown_refuses_a_run_that_holds_its_lock_and_stop_interrupts_it(tmp_path):
    """A `make gsm8k RUN=R` in a terminal holds .stoa/runs/R/.lock (the lock embedded/run.py takes through
    infra/boxops.lock_run_dir, taken here by a real child process): `invoke teardown --local --purge --yes`
    refuses in one sentence (exit 2), naming `invoke stop`, and deletes nothing; `invoke stop` stops the holder
    (SIGTERM, which the launcher takes as Ctrl-C, and which ends this holder) and deletes nothing, also where
    SIGINT is ignored (a launcher in a script's background; pytest-xdist's workers); then teardown purges it. A
    lock held by a process that did not write itself down is refused by stop too: there is no PID to signal."""
    import subprocess

    run_id = "live-lock-run"
    state = tmp_path / ".stoa" / "runs" / run_id
    take = "lock = lock_run_dir(p.run_dir, create=True, launcher=True); assert lock"
    holder = subprocess.Popen(  # SIGINT ignored, as by a background job of a script: stop still works
        [sys.executable, "-c", "import signal, sys, time; from pathlib import Path; "
         "signal.signal(signal.SIGINT, signal.SIG_IGN); "
         "from embedded.run import EmbeddedPaths; from infra.boxops import lock_run_dir; "
         f"p = EmbeddedPaths(Path({str(tmp_path / '.stoa')!r}), {run_id!r}); p.run_dir.mkdir(parents=True); "
         f"p.key_file.write_text('key'); p.metrics.write_text('{{}}'); {take}; "
         "print('locked', flush=True); time.sleep(300)"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    invoke = str(Path(sys.executable).with_name("invoke"))

    def inv(*argv):
        return subprocess.run([invoke, *argv, "--run", run_id, "--local", "--remote-dir", str(tmp_path)],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)

    try:
        assert holder.stdout.readline().strip() == "locked"
        for argv in (["teardown", "--purge", "--yes"], ["teardown", "--dry-run"]):
            res = inv(*argv)
            assert res.returncode == 2, (argv, res.stdout, res.stderr)
            assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
            assert f"run {run_id} is running on this machine" in res.stderr and "refused" in res.stderr
            assert f"invoke stop --run {run_id} --local" in res.stderr
        dry = inv("stop", "--dry-run")
        assert dry.returncode == 0 and json.loads(dry.stdout)["launcher"] == holder.pid, dry.stdout + dry.stderr
        assert holder.poll() is None
        res = inv("stop", "--yes")
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"stop the launcher of run {run_id} (pid {holder.pid}" in res.stdout
        assert json.loads(res.stdout[res.stdout.index("{"):])["stopped"] is True
        assert holder.wait(timeout=30) == -signal.SIGTERM  # make gsm8k's launcher takes it as a clean stop
        assert (state / "trainer.key").read_text() == "key" and (state / "metrics.jsonl").exists()
    finally:
        if holder.poll() is None:
            holder.terminate()  # the test started it; end it by PID
        holder.wait(timeout=30)
    from infra.boxops import lock_holder, lock_run_dir

    held = lock_run_dir(state, create=True)  # a moment's holder (a probe, stop's own, teardown's) writes nothing
    assert held is not None and lock_holder(state) is None  # the launcher's record names a process now gone
    held.close()
    raw = subprocess.Popen(  # the lock taken without lock_run_dir: no holder written down
        [sys.executable, "-c", f"import fcntl, time; f = open({str(state / '.lock')!r}, 'w'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(300)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert raw.stdout.readline().strip() == "locked"
        res = inv("stop", "--yes")
        assert res.returncode == 2 and "stop refused" in res.stderr and raw.poll() is None, res.stderr
    finally:
        raw.terminate()
        raw.wait(timeout=30)
    res = inv("teardown", "--purge", "--yes")
    assert res.returncode == 0, res.stderr
    assert not state.exists()


def test_the_launchers_lock_record_names_it_without_proc_too(tmp_path, monkeypatch):
    """macOS has no /proc: the record's start in clock ticks is None there, and stop found no holder, so it
    refused and named itself as the fix. psutil's creation time names the launcher instead."""
    monkeypatch.setattr(boxops, "_proc_start", lambda pid: None)
    lock = boxops.lock_run_dir(tmp_path, create=True, launcher=True)
    try:
        assert boxops.lock_holder(tmp_path) == os.getpid()
        record = json.loads((tmp_path / boxops.RUN_LOCK).read_text())
    finally:
        lock.close()
    (tmp_path / boxops.RUN_LOCK).write_text(json.dumps({**record, "created": record["created"] - 5}))
    assert boxops.lock_holder(tmp_path) is None  # a recycled PID: another process's creation time


def test_logs_of_a_run_with_no_log_name_where_they_looked(sshd_server, tmp_path, capfd):  # noqa: F811
    # over SSH and here alike: no log yet is a sentence naming the file and how to start the run (it was
    # tail's own "cannot open"); here the embedded run's learner.log is shown when the box log is absent
    from infra.remote.ops import NoLogYet

    tree = tmp_path / "tree"
    tree.mkdir()
    with pytest.raises(NoLogYet, match=rf"{tree}/logs/r1.log does not exist; start the run with `make gsm8k RUN=r1 HOST="):
        logs(sshd_server.host, "r1", ssh_key=str(sshd_server.client_key), remote_dir=str(tree))
    with pytest.raises(NoLogYet, match=r"learner.log exists; start the run with `make gsm8k RUN=r1`"):
        logs(None, "r1", remote_dir=str(tree))
    (tree / ".stoa/runs/r1").mkdir(parents=True)
    (tree / ".stoa/runs/r1/learner.log").write_text("step 1\nstep 2\n")
    capfd.readouterr()
    assert logs(None, "r1", remote_dir=str(tree), lines=1) == 0
    assert capfd.readouterr().out == "step 2\n"
