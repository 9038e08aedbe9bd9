"""infra/patches: the patch set applies to a tree it fits, idempotently, and refuses one it does not fit.

The fixture tree is rebuilt from each patch's own preimage (its context and removed lines), so it is
exactly "a slime tree this patch fits" without copying slime into the repository.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from infra.patches import apply as patches

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@")


def preimages(patch_path: Path) -> dict[str, list[str]]:
    """file -> the lines a tree must hold for the patch to apply (hunks in order, filler between)."""
    files: dict[str, list[str]] = {}
    current = None
    in_hunk = False
    for line in patch_path.read_text().splitlines():
        if line.startswith("--- a/"):
            current, in_hunk = line[len("--- a/"):], False
            files[current] = [f"# fixture of {current}"]
        elif line.startswith("+++ "):
            continue
        elif current and HUNK.match(line):
            in_hunk = True
            files[current].append("# --- between hunks ---")
        elif current and in_hunk and line[:1] in (" ", "-"):
            files[current].append(line[1:])
        elif current and in_hunk and line == "":
            files[current].append("")
        elif line.startswith("diff --git"):
            current, in_hunk = None, False
    return files


def make_tree(root: Path, patch_list) -> Path:
    tree = root / "slime"
    for p in patch_list:
        for rel, lines in preimages(p.path).items():
            f = tree / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text("\n".join(lines) + "\n")
    (tree / patches.SLIME_MARKER).parent.mkdir(parents=True, exist_ok=True)
    (tree / patches.SLIME_MARKER).touch(exist_ok=True)
    return tree


def snapshot(tree: Path) -> dict[str, bytes]:
    return {str(p.relative_to(tree)): p.read_bytes() for p in sorted(tree.rglob("*")) if p.is_file()
            and ".git" not in p.parts}


def test_every_patch_names_upstream_commit_need_and_when_it_can_go():
    found = patches.load_patches()
    assert found, "the patch set is empty"
    for p in found:
        assert "github.com/THUDM/slime" in p.header["Upstream"]
        assert re.search(r"\b[0-9a-f]{7,40}\b", p.header["Fits"]), p.header["Fits"]
        assert len(p.header["Need"]) > 40 and p.header["Can go"]


def test_applies_cleanly_verifies_and_is_idempotent(tmp_path):
    plist = patches.load_patches()
    tree = make_tree(tmp_path, plist)
    before = snapshot(tree)
    states = patches.apply_patches(tree, log=lambda *_: None)
    assert set(states.values()) == {"applies"}
    after = snapshot(tree)
    assert after != before
    args_py = (tree / "slime/utils/arguments.py").read_text()
    actor_py = (tree / "slime/backends/megatron_utils/actor.py").read_text()
    assert '"--custom-after-train-hook-path"' in args_py
    assert "self.after_train_hook(self.args, rollout_id, self.model)" in actor_py
    patches.verify_applied(tree, plist)

    logged: list[str] = []
    states = patches.apply_patches(tree, log=logged.append)
    assert set(states.values()) == {"applied"}
    assert all("already applied" in line for line in logged)
    assert snapshot(tree) == after


def test_dry_run_changes_nothing(tmp_path):
    tree = make_tree(tmp_path, patches.load_patches())
    before = snapshot(tree)
    logged: list[str] = []
    patches.apply_patches(tree, dry_run=True, log=logged.append)
    assert snapshot(tree) == before
    assert any("would apply" in line for line in logged)


def test_refuses_a_tree_it_does_not_fit_and_changes_nothing(tmp_path):
    plist = patches.load_patches()
    tree = make_tree(tmp_path, plist)
    actor = tree / "slime/backends/megatron_utils/actor.py"
    actor.write_text(actor.read_text().replace("self.train_actor(rollout_id", "self.train_policy(rollout_id"))
    before = snapshot(tree)
    with pytest.raises(patches.PatchRefused) as e:
        patches.apply_patches(tree, log=lambda *_: None)
    msg = str(e.value)
    assert "0001-after-train-hook.patch does not fit" in msg and "624b824a" in msg
    assert "nothing was changed" in msg and "git checkout" in msg
    assert snapshot(tree) == before  # the other file, which would fit, was not touched either
    assert patches.main(["--tree", str(tree)]) == 1


def test_refuses_a_directory_that_is_not_slime(tmp_path):
    with pytest.raises(patches.PatchRefused, match="not a slime checkout"):
        patches.apply_patches(tmp_path, log=lambda *_: None)


def test_patch_without_header_is_refused(tmp_path):
    bad = tmp_path / "0002-bad.patch"
    bad.write_text("diff --git a/x b/x\n")
    with pytest.raises(ValueError, match="Upstream, Fits, Need, Can go"):
        patches.load_patches(tmp_path)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def test_three_way_merge_when_context_moved_in_a_git_checkout(tmp_path):
    """A git tree whose context drifted (plain apply fails) but merges cleanly gets the patch 3-way."""
    tree = tmp_path / "slime"
    (tree / "slime/utils").mkdir(parents=True)
    target = tree / "slime/utils/arguments.py"
    lines = [f"line {i}" for i in range(30)]
    target.write_text("\n".join(lines) + "\n")
    _git(tree, "init", "-q")
    _git(tree, "add", ".")
    _git(tree, "commit", "-qm", "base")
    target.write_text("\n".join(lines[:15] + ["added by us"] + lines[16:]) + "\n")
    diff = _git(tree, "diff", "--full-index")
    _git(tree, "checkout", "-q", "--", ".")
    ours = tmp_path / "patches"
    ours.mkdir()
    pfile = ours / "0001-test.patch"
    pfile.write_text("Upstream: https://github.com/THUDM/slime\nFits: 0000000 (test)\nNeed: a test of the "
                     "three-way path of the applier, long enough\nCan go: never\n\n" + diff)
    target.write_text("\n".join(lines[:12] + ["upstream moved this"] + lines[13:]) + "\n")
    _git(tree, "commit", "-qam", "upstream drift")
    plist = patches.load_patches(ours)
    assert patches.patch_state(tree, plist[0])[0] == "applies-3way"
    patches.apply_patches(tree, patches=plist, log=lambda *_: None)
    text = target.read_text()
    assert "added by us" in text and "upstream moved this" in text and "<<<<<<<" not in text
    assert patches.apply_patches(tree, patches=plist, log=lambda *_: None) == {"0001-test.patch": "applied"}
