"""How an embedded run's ending is told: who stopped it (the launcher's own signal, one sent to the learner
alone, its own end at a step short of the recipe's) in words and in the exit status, and a child's log tail
from this session only. Real child processes stand in for the learner (their exit status is what counts)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from embedded.config import resolve_embedded
from embedded.localprocs import Processes
from embedded.run import _ending, interrupted
from embedded.view import RunState


def _learner(tmp_path: Path, code: str, log_text: str = ""):
    log = tmp_path / "learner.log"
    log.write_text(log_text)
    procs = Processes()
    child = procs.start("learner", [sys.executable, "-c", code], {}, log)
    child.proc.wait(timeout=60)
    return child


def _at(step: int):
    cfg = resolve_embedded("gsm8k", env={"DRL_RUN": "x"})
    cfg.train.num_steps = 300
    return cfg, RunState(run="x", max_steps=300, budget_s=600, step=step)


class _Console:
    def __init__(self):
        self.lines: list[str] = []

    def print(self, *a, **_k):
        self.lines.append(" ".join(map(str, a)))


def test_sigterm_to_the_learner_is_not_a_finished_run(tmp_path):
    """SIGTERM to the learner alone once ended 'run finished', exit 0, at step 140 of 300."""
    cfg, state = _at(140)
    child = _learner(tmp_path, "import sys; sys.exit(143)")  # entrypoints.learner stopped by SIGTERM
    reason, rc = _ending(cfg, state, child, False, "finished", 0, _Console())
    assert (reason, rc) == ("the learner was stopped by SIGTERM at step 140 of 300", 143)
    child = _learner(tmp_path, "pass")  # ended on its own, short of the recipe's steps
    reason, rc = _ending(cfg, state, child, False, "finished", 0, _Console())
    assert reason == "the learner ended at step 140 of 300" and rc == 1
    # the stop the launcher asked for (time budget, its own signal) keeps the launcher's words
    assert _ending(cfg, state, child, True, "time budget of 600 s reached", 0, _Console()) == (
        "time budget of 600 s reached", 0)
    child = _learner(tmp_path, "import sys; sys.exit(143)")
    assert _ending(cfg, state, child, True, *interrupted(signal.SIGTERM), _Console()) == (
        "stopped by SIGTERM (invoke stop, or another process)", 143)
    cfg, state = _at(300)
    assert _ending(cfg, state, _learner(tmp_path, "pass"), False, "finished", 0, _Console()) == ("300 steps done", 0)


def test_sigterm_to_the_launcher_is_not_ctrl_c():
    """SIGTERM to `make gsm8k` once said 'stopped by Ctrl-C' with 130."""
    assert interrupted(signal.SIGINT) == ("stopped by Ctrl-C", 130)
    assert interrupted(signal.SIGTERM) == ("stopped by SIGTERM (invoke stop, or another process)", 143)


def test_a_killed_childs_tail_is_from_this_session(tmp_path):
    """After a SIGKILL the tail shown was an earlier session's last lines (the log is appended to)."""
    child = _learner(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                     log_text="step 12 from yesterday's session\n")
    assert "yesterday" not in child.tail() and "wrote nothing" in child.tail()
    child = _learner(tmp_path, "print('today', flush=True)", log_text="old line\n")
    assert child.tail() == "today"


def test_a_learner_failure_shows_on_the_panel(tmp_path):
    """A full store stalled the run while the panel said nothing: the failure was only in learner.log."""
    from rich.console import Console

    from embedded.view import learner_alert, panel

    child = _learner(tmp_path, "print('10:01:02 trainer.native.learner step 3 v4: reward 0.5'); "
                               "print('10:01:09 trainer.publish.queue publishing the weights of step 4 failed: "
                               "put x: HTTP 507 InsufficientStorage', flush=True)")
    alert = learner_alert(child.tail(40))
    assert alert and alert.startswith("publishing the weights of step 4 failed") and "507" in alert
    assert learner_alert("10:00:00 x step 5 v6: reward 0.5") is None
    _cfg, state = _at(4)
    state.alert = alert
    console = Console(record=True, width=200)
    console.print(panel(state))
    assert "publishing the weights of step 4 failed" in console.export_text()


def test_printed_commands_paste_as_they_are_with_spaces_in_paths(tmp_path):
    """The dry run's commands once printed a checkout path with a space unquoted: pasted, it split in two."""
    import shlex

    from embedded.run import EmbeddedPaths, embedded_cfg, plan_lines

    root = tmp_path / "my checkout" / ".stoa"
    cfg, _ = _at(0)
    paths = EmbeddedPaths(root, "x")
    lines = plan_lines(embedded_cfg(cfg, paths), paths)
    learner = next(line for line in lines if line.startswith("3. learner: "))[len("3. learner: "):]
    argv = shlex.split(learner.split(" (Ray on")[0])
    assert str(paths.run_dir / "recipe.json") in argv and str(paths.run_dir) in argv, argv


def test_the_summary_off_a_terminal_keeps_whole_lines(tmp_path, capsys):
    """Off a terminal the summary was cut to 80 columns: the metrics path and the verify command lost their ends."""
    from embedded.run import EmbeddedPaths, default_console
    from embedded.view import summary

    paths = EmbeddedPaths(tmp_path / ("a-long-directory-name-" * 4) / ".stoa", "x")
    _cfg, state = _at(3)
    summary(default_console(), state, paths=paths, plots=[], stop_reason="3 steps done",
            store_url=f"file://{tmp_path}/bucket")
    out = capsys.readouterr().out
    assert str(paths.metrics) in out and f"--store file://{tmp_path}/bucket --run x" in out, out


def test_the_summary_on_a_narrow_terminal_keeps_paths_and_commands_whole(tmp_path):
    """On an 80-column terminal the summary's table cut its plot paths ("…/plots/train_reward.p…"): what a user
    copies (paths, the check and resume commands) is printed whole, one line each, the terminal wrapping it."""
    import io

    from rich.console import Console

    from embedded.run import EmbeddedPaths
    from embedded.view import summary

    paths = EmbeddedPaths(tmp_path / ("a-long-directory-name-" * 3) / ".stoa", "x")
    plot = paths.run_dir / "plots" / "heldout_accuracy.png"
    _cfg, state = _at(3)
    buf = io.StringIO()
    summary(Console(file=buf, width=80, force_terminal=True, color_system=None), state, paths=paths, plots=[plot],
            stop_reason="3 steps done", store_url=f"file://{tmp_path}/bucket")
    lines = buf.getvalue().splitlines()
    for whole in (str(plot), str(paths.metrics), f"--store file://{tmp_path}/bucket --run x", "RUN=x"):
        assert any(whole in line for line in lines), (whole, buf.getvalue())


def test_a_resumed_run_shows_this_sessions_counts_not_a_mix(tmp_path):
    """A resumed learner counts groups and drops from 0 (it reads the bucket again). The panel once showed the
    last session's 1006 groups, then this session's 58, and the summary's total was this session's alone."""
    from embedded.run import EmbeddedPaths, _run_state
    from embedded.view import status_line

    cfg, _ = _at(0)
    paths = EmbeddedPaths(tmp_path, "x")
    paths.run_dir.mkdir(parents=True)
    old = {"step": 142, "version": 141, "rollout/raw_reward": 0.5, "rollout/accepted": 1006.0,
           "rollout/drops/stale": 58.0, "worker/local-0/groups": 600.0}
    paths.metrics.write_text(json.dumps(old) + "\n")
    state, _tail = _run_state(cfg, paths)
    assert state.step == 142 and "groups 0 " in status_line(state) and "drops none" in status_line(state)
    state.update({"step": 143, "version": 143, "rollout/raw_reward": 0.5, "rollout/accepted": 30.0,
                  "rollout/drops/stale": 15.0, "worker/local-0/groups": 20.0})
    line = status_line(state)
    assert "groups 30 " in line and "stale 15" in line and state.workers == {"local-0": 20.0}, line
    assert state.session_first_step == 143


def test_the_printed_change_is_the_difference_of_the_printed_shares(tmp_path, capsys):
    """The summary printed 24.8% -> 54.0% (+29.3 points): the change came from the unrounded 24.75%."""
    from embedded.run import EmbeddedPaths, default_console
    from embedded.view import summary

    _cfg, state = _at(10)
    state.evals = [(0, 1, 0.2475), (10, 11, 0.54)]
    summary(default_console(), state, paths=EmbeddedPaths(tmp_path, "x"), plots=[], stop_reason="10 steps done",
            store_url=f"file://{tmp_path}/bucket")
    out = capsys.readouterr().out
    assert "24.8% -> 54.0% (+29.2 points)" in out
    # and which versions those are: the last, the final evaluation's, came after the panel's last frame
    assert "(+29.2 points); v1 -> v11" in out, out


def test_sigterm_during_the_set_up_ends_it_as_ctrl_c_does(tmp_path):
    """`invoke stop` sends a running launcher SIGTERM; during its set-up (here the base model's build) that once
    killed it where it stood, before its handlers were there. It ends as after Ctrl-C: `interrupted`, 130, the
    run's lock let go."""
    import subprocess
    import time

    from infra.boxops import lock_holder, run_is_live

    code = ("import sys\nfrom pathlib import Path\nfrom embedded.config import resolve_embedded\n"
            "from embedded.run import run_embedded\nfrom worker_contract.cli import run_main\n"
            "cfg = resolve_embedded('gsm8k', env={}, overrides={'run': 'term-1', 'embedded.base.sft_steps': 100000})\n"
            "sys.exit(run_main(lambda: run_embedded(cfg, root=Path(sys.argv[1])), 'make gsm8k'))\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=Path(__file__).resolve().parents[1],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "runs" / "term-1"
    try:
        deadline = time.monotonic() + 120
        while lock_holder(run_dir) != proc.pid and time.monotonic() < deadline:
            time.sleep(0.2)
        assert lock_holder(run_dir) == proc.pid
        time.sleep(1.0)  # inside the set-up
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "make gsm8k: interrupted", (proc.returncode, err)
    assert not run_is_live(run_dir)


def test_transformers_notes_are_kept_off_the_panel(caplog):
    """A resumed psqa run printed transformers' "causal_conv1d_fn is falling back" note twice over its panel
    (the launcher's first held-out forward); the base's build hid it, the run did not. Errors still show.
    (The records, not a stream: transformers' handler keeps whichever stderr it first found, which under
    pytest-xdist is not the one this test captures.)"""
    from transformers.utils import logging as hf_logging

    from embedded.view import transformers_errors_only

    log = hf_logging.get_logger("transformers.models.lfm2.modeling_lfm2")
    library = hf_logging.get_logger("transformers")  # it does not propagate to the root logger caplog watches
    before = hf_logging.get_verbosity()
    library.addHandler(caplog.handler)
    try:
        with transformers_errors_only():
            log.warning("a note the user cannot act on")
            log.error("an error the user must see")
    finally:
        library.removeHandler(caplog.handler)
    assert hf_logging.get_verbosity() == before
    said = [r.getMessage() for r in caplog.records]
    assert "an error the user must see" in said and "a note the user cannot act on" not in said, said
