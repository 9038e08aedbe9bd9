"""tests/leftovers.py in a suite of its own: a test that leaves a process running (in a session of its own,
as a killed learner's Ray actor was) has it named with that test in the summary and ended by PID."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

LEAKY = '''import subprocess, sys

def test_leaks():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    open("{pid_file}", "w").write(str(child.pid))

def test_tidy():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''


def test_a_process_a_test_left_running_is_named_and_ended(tmp_path):
    pid_file = tmp_path / "child.pid"
    (tmp_path / "test_leaky.py").write_text(LEAKY.replace("{pid_file}", str(pid_file)))
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "leftovers", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), str(tmp_path / "test_leaky.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    pid = int(pid_file.read_text())
    assert "processes the tests left running (ended now)" in out.stdout, out.stdout
    assert f"PID {pid} (started during test_leaky.py::test_leaks (call))" in out.stdout, out.stdout
    assert "test_tidy" not in out.stdout.split("left running")[1]
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:  # ended, and reaped by init
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]
