"""Every bench/results/*.json names the commit that ran it, the machine and the exact command.

The forms accepted (bench/common.provenance and write_result write them; docs/performance.md says so):
- `commit` (top level, else in `machine`): 40 hex digits, or "unknown" only beside a `provenance_note` that says why;
- `clean` (top level, else in `machine`): true, or a `provenance_note` (a dirty or unknown tree is said, never hidden); a `-dirty` commit
  in `machine` counts as not clean;
- `machine`: a dict naming the CPU or the GPU; `command`: the command line, or "unknown" with the note;
- `provenance_recovered`: where a field was added after the run (from git history), a dict field -> how.
Beyond the form: the commit in git's history, a GPU result's GPU, its raw files; no doc quotes superseded/.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from bench import common

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
HEX40 = re.compile(r"[0-9a-f]{40}")
#: a result of a GPU run says so in its name (bench/results/<bench>_gpu_..., ..._h200_...)
GPU_NAME = re.compile(r"(^|_)(gpu|h100|h200|b200)(x[0-9]+)?(_|\.|$)")


def problems(doc: object) -> list[str]:
    """What a result document lacks, as short phrases; empty when its provenance is complete."""
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    out, note = [], doc.get("provenance_note")
    if note is not None and not (isinstance(note, str) and len(note.strip()) >= 20):
        out.append("provenance_note must be a sentence")
    has_note = isinstance(note, str) and len(note.strip()) >= 20
    machine = doc.get("machine")
    inner = machine if isinstance(machine, dict) else {}
    commit = doc.get("commit", inner.get("commit"))  # bench.common.machine_info carries them too
    if commit == "unknown":
        if not has_note:
            out.append("commit 'unknown' without a provenance_note")
    elif not (isinstance(commit, str) and HEX40.fullmatch(commit)):
        out.append(f"commit {commit!r} is not 40 hex digits")
    if machine == "unknown":
        if not has_note:
            out.append("machine 'unknown' without a provenance_note")
    elif not (isinstance(machine, dict) and (machine.get("cpu") or machine.get("gpu"))):
        out.append("machine does not name a CPU or GPU")
    elif isinstance(commit, str) and HEX40.fullmatch(commit):
        named = str(machine.get("commit") or "unknown").removesuffix("-dirty")
        if named != "unknown" and not commit.startswith(named):
            out.append(f"machine.commit {named!r} is not commit {commit[:12]}")
    command = doc.get("command")
    if command == "unknown":
        if not has_note:
            out.append("command 'unknown' without a provenance_note")
    elif not (isinstance(command, str) and command.strip()) and not (
            isinstance(command, list) and command and all(isinstance(c, str) and c for c in command)):
        out.append("no command")
    dirty = str(inner.get("commit", "")).endswith("-dirty")
    if (doc.get("clean", inner.get("clean")) is not True or dirty) and not has_note:
        out.append("tree not recorded clean (clean is not true) and no provenance_note")
    recovered = doc.get("provenance_recovered")
    if recovered is not None and not (isinstance(recovered, dict) and recovered
                                      and all(isinstance(v, str) and v for v in recovered.values())):
        out.append("provenance_recovered must map each recovered field to how it was recovered")
    return out


def beyond_form(name: str, doc: dict, in_history) -> list[str]:
    """What the form cannot see: the commit in git's history (`in_history(commit) -> bool`), the GPU of a GPU
    result, and the raw files the result lists."""
    out = []
    machine = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
    commit = str(doc.get("commit", machine.get("commit", "unknown"))).removesuffix("-dirty")
    if HEX40.fullmatch(commit) and not in_history(commit):
        out.append(f"commit {commit[:12]} is not in this repository's history")
    if GPU_NAME.search(name.lower()) and not (isinstance(machine.get("gpu"), str) and machine["gpu"].strip()):
        out.append("a GPU result whose machine names no GPU")
    raw = doc.get("raw", [])
    for f in raw if isinstance(raw, list) else [raw]:
        if not (RESULTS / str(f)).is_file():
            out.append(f"raw file {f} is not beside it")
    return out


def _in_history(commit: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO,
                          capture_output=True).returncode == 0


def _shallow() -> bool:
    out = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True)
    return out.returncode != 0 or out.stdout.strip() != "false"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_result_file_names_commit_machine_and_command(path: Path) -> None:
    assert not problems(json.loads(path.read_text())), f"{path.name}: {problems(json.loads(path.read_text()))}"
    if _shallow():
        pytest.skip("a shallow clone holds too little history to look the commits up")
    found = beyond_form(path.name, json.loads(path.read_text()), _in_history)
    assert not found, f"{path.name}: {found}"


def test_the_history_check_refuses_what_it_should() -> None:
    doc = {"commit": "c" * 40, "machine": {"cpu": "x"}, "raw": ["nothing_here.txt"]}
    found = beyond_form("megatron_gpu_h200_x.json", doc, lambda c: False)
    assert any("history" in f for f in found) and any("GPU" in f for f in found) and any("raw" in f for f in found)
    ok = {"commit": "c" * 40, "machine": {"gpu": "NVIDIA H200"}}
    assert beyond_form("megatron_gpu_h200_x.json", ok, lambda c: True) == []


def test_no_doc_quotes_a_superseded_result() -> None:
    superseded = [p.name for p in (RESULTS / "superseded").glob("*.json")]
    docs = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "runs").rglob("*.md")]
    quoting = [(d.relative_to(REPO).as_posix(), name) for d in docs for name in superseded
               if name in d.read_text()]
    assert not quoting, f"docs quote superseded results: {quoting}"


def test_the_check_refuses_what_it_should() -> None:
    good = {"commit": "a" * 40, "clean": True, "machine": {"cpu": "x"}, "command": "python -m bench.x"}
    assert problems(good) == []
    note = "recorded after the run from the commit that added the file"
    assert problems({**good, "commit": "a" * 7}) and problems({**good, "command": ""})
    assert problems({k: v for k, v in good.items() if k != "machine"})
    assert problems({**good, "commit": "unknown"}) and not problems({**good, "commit": "unknown",
                                                                       "provenance_note": note})
    assert problems({**good, "clean": False}) and not problems({**good, "clean": False, "provenance_note": note})
    assert problems({**good, "machine": {"cpu": "x", "commit": "b" * 40}})
    assert problems({**good, "machine": {"cpu": "x", "commit": "a" * 40 + "-dirty"}})
    assert problems({**good, "provenance_recovered": {"commit": ""}})
    inner = {"machine": {"cpu": "x", "commit": "a" * 40, "clean": True}, "command": "python -m bench.x"}
    assert problems(inner) == [] and problems({**inner, "machine": {**inner["machine"], "clean": None}})


def test_write_result_records_provenance(tmp_path: Path) -> None:
    """What write_result writes passes the check on a clean tree and says `clean: false` on a dirty one."""
    out = common.write_result("probe", {"x": 1}, tmp_path / "probe.json", argv=["--x", "1"])
    doc = json.loads(out.read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=RESULTS.parent, capture_output=True,
                          text=True).stdout.strip()
    assert doc["commit"] == head and doc["command"].endswith("--x 1") and doc["machine"]["cpu"]
    assert isinstance(doc["clean"], bool) and isinstance(doc["status_porcelain"], str)
    assert problems(doc) == ([] if doc["clean"] else
                             ["tree not recorded clean (clean is not true) and no provenance_note"])


def test_a_copied_tree_inside_another_checkout_takes_the_senders_commit(tmp_path: Path) -> None:
    """A `git archive` of the tree unpacked under an ignored folder of a clone (how a GPU box gets an exact
    commit) is measured as the commit it was made from (STOA_COMMIT), never as the clone around it."""
    import os
    import shutil
    import sys

    outer = tmp_path / "clone"
    (outer / ".carry" / "src" / "bench").mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(outer)]
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    (outer / "README").write_text("the clone around the copy\n")
    subprocess.run([*git, "add", "README"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "outer"], check=True)
    for name in ("__init__.py", "common.py"):
        shutil.copy(RESULTS.parent / name, outer / ".carry" / "src" / "bench" / name)
    probe = "import json; from bench import common; print(json.dumps([common.provenance(), common.git_commit()]))"

    def measured(**env: str) -> list:
        out = subprocess.run([sys.executable, "-c", probe], cwd=outer / ".carry" / "src", capture_output=True,
                             text=True, env={**{k: v for k, v in os.environ.items() if not k.startswith("STOA_")},
                                             **env}, check=True)
        return json.loads(out.stdout)

    sent = "b" * 40
    prov, commit = measured(STOA_COMMIT=sent, STOA_CLEAN="1")
    assert prov == {"commit": sent, "status_porcelain": "", "clean": True} and commit == sent
    prov, commit = measured()
    assert prov["commit"] == "unknown" and prov["clean"] is None and commit == "unknown"


def test_the_reliability_doc_quotes_the_soak_file() -> None:
    """docs/reliability.md's soak figures are the ones bench/results/soak.json holds (bench/soak_doc.py)."""
    from bench import soak_doc

    text = soak_doc.DOC.read_text()
    assert soak_doc.rewrite(text, soak_doc.render(json.loads(soak_doc.SOAK.read_text()))) == text, (
        "docs/reliability.md's soak figures differ from bench/results/soak.json: run python -m bench.soak_doc")


def test_the_device_script_runs_a_command_on_the_exact_commit(tmp_path: Path) -> None:
    """bench/device.sh pack + run (no wheels): the command runs in the unpacked tree of HEAD, and a benchmark
    there reports HEAD as its commit (STOA_COMMIT), not the checkout around it."""
    import os
    import shutil
    import sys

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOA_")}
    subprocess.run(["bash", "bench/device.sh", "pack", "--no-wheels"], cwd=clone, check=True, env=env,
                   capture_output=True)
    (clone / "bench" / "common.py").write_text("raise SystemExit('the checkout, not the packed tree')\n")
    probe = "from bench import common; print(common.provenance()['commit'])"
    out = subprocess.run(["bash", "bench/device.sh", "run", "--", sys.executable, "-c", probe], cwd=clone,
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == head, out.stderr
    shutil.rmtree(clone / ".carry")
    out = subprocess.run(["bash", "bench/device.sh", "run", "--", "true"], cwd=clone, capture_output=True, text=True)
    assert out.returncode == 2 and "pack" in out.stderr
