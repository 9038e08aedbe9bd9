"""infra/patches: the patch set applies to a tree it fits, idempotently, refuses one it does not fit, skips
what slime already does, and checks after applying that the behaviour is there (the probes).

The fixture tree is slime-shaped Python (the skeletons below) with each patch's own preimage (its context
and removed lines) filled in, so it is exactly "a slime tree this patch fits", parses like slime, and holds
no copy of slime.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from infra.patches import apply as patches
from infra.patches import probes

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@")

#: file -> slime-shaped code around the patch's hunks ({0}, {1}: the preimage of hunk 0, 1 of that file)
SKELETONS = {
    "slime/backends/megatron_utils/actor.py": """\
class MegatronTrainRayActor(TrainRayActor):
    def init(self, args, role):
        self.args, self.role = args, role
        start_rollout_id = 0
        if self.args.rollout_data_postprocess_path is not None:
            from slime.utils.misc import load_function
{0}
    def train(self, rollout_id, rollout_data_ref, external_data=None):
        rollout_data = rollout_data_ref
        if self.role == "critic":
            result = self.train_critic(rollout_id, rollout_data)
{1}
            self.sleep()

        return result
""",
    "slime/utils/arguments.py": """\
def get_slime_extra_args_provider(add_custom_arguments=None):
    def add_slime_arguments(parser):
        def add_custom_arguments(parser):
            parser.add_argument(
                "--custom-megatron-init-path",
{0}
                default=None,
            )
            return parser

        return add_custom_arguments(parser)

    return add_slime_arguments
""",
    "slime/backends/megatron_utils/loss.py": """\
def policy_loss_function(args, batch, logits, sum_of_sample_mean):
    ppo_kl = advantages = log_probs = opsm_mask = None
{0}
    return pg_loss, pg_clipfrac
""",
}


def preimages(patch_path: Path) -> dict[str, list[list[str]]]:
    """file -> the preimage of each of its hunks (the lines a tree must hold for the patch to apply)."""
    files: dict[str, list[list[str]]] = {}
    current = None
    for line in patch_path.read_text().splitlines():
        if line.startswith("--- a/"):
            current = line[len("--- a/"):]
            files[current] = []
        elif line.startswith("+++ "):
            continue
        elif current and HUNK.match(line):
            files[current].append([])
        elif current and files[current] and line[:1] in (" ", "-"):
            files[current][-1].append(line[1:])
        elif current and files[current] and line == "":
            files[current][-1].append("")
        elif line.startswith("diff --git"):
            current = None
    return files


def make_tree(root: Path, patch_list) -> Path:
    tree = root / "slime"
    for p in patch_list:
        for rel, hunks in preimages(p.path).items():
            f = tree / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(SKELETONS[rel].format(*("\n".join(h) for h in hunks)))
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
    lines = [f"line_{i} = {i}" for i in range(30)]
    target.write_text("\n".join(lines) + "\n")
    _git(tree, "init", "-q")
    _git(tree, "add", ".")
    _git(tree, "commit", "-qm", "base")
    target.write_text("\n".join(lines[:15] + ["added_by_us = 1"] + lines[16:]) + "\n")
    diff = _git(tree, "diff", "--full-index")
    _git(tree, "checkout", "-q", "--", ".")
    ours = tmp_path / "patches"
    ours.mkdir()
    pfile = ours / "0001-test.patch"
    pfile.write_text("Upstream: https://github.com/THUDM/slime\nFits: 0000000 (test)\nNeed: a test of the "
                     "three-way path of the applier, long enough\nCan go: never\n\n" + diff)
    target.write_text("\n".join(lines[:12] + ["upstream_moved_this = 1"] + lines[13:]) + "\n")
    _git(tree, "commit", "-qam", "upstream drift")
    plist = patches.load_patches(ours)
    assert patches.patch_state(tree, plist[0])[0] == "applies-3way"
    patches.apply_patches(tree, patches=plist, log=lambda *_: None)
    text = target.read_text()
    assert "added_by_us" in text and "upstream_moved_this" in text and "<<<<<<<" not in text
    assert patches.apply_patches(tree, patches=plist, log=lambda *_: None) == {"0001-test.patch": "applied"}


# -- what each patch is for, read off the tree (infra/patches/probes.py) --------------------------------
def test_every_patch_has_a_probe_that_fails_before_and_holds_after(tmp_path):
    plist = patches.load_patches()
    assert {p.name for p in plist} == set(probes.PROBES)
    tree = make_tree(tmp_path, plist)
    assert [p.probe(tree)[0] for p in plist] == [False] * len(plist)
    patches.apply_patches(tree, log=lambda *_: None)
    verdicts = {p.name: p.probe(tree) for p in plist}
    assert all(ok for ok, _ in verdicts.values()), verdicts
    assert "calls self.after_train_hook(self.args, rollout_id, self.model)" in verdicts["0001-after-train-hook.patch"][1]


def _upstream_fixed(tree: Path) -> None:
    """The loss call as slime has it since 78156c53c: eps_clip_c passed on."""
    loss = tree / probes.LOSS
    loss.write_text(loss.read_text().replace("args.eps_clip, args.eps_clip_high)",
                                             "args.eps_clip, args.eps_clip_high, eps_clip_c=args.eps_clip_c)"))


def test_dual_clip_patch_is_skipped_where_slime_already_passes_eps_clip_c(tmp_path):
    plist = patches.load_patches()
    tree = make_tree(tmp_path, plist)
    _upstream_fixed(tree)
    loss_before = (tree / probes.LOSS).read_text()
    logged: list[str] = []
    states = patches.apply_patches(tree, log=logged.append)
    assert states == {"0001-after-train-hook.patch": "applies", "0002-dual-clip-epsilon.patch": "upstream"}
    assert (tree / probes.LOSS).read_text() == loss_before
    assert any("0002" in line and "not needed" in line for line in logged), logged
    assert patches.summary(states) == ("0001-after-train-hook: applied; "
                                       "0002-dual-clip-epsilon: not needed (slime already does it)")


def test_dual_clip_patch_refused_naming_the_upstream_fix_where_it_does_not_fit(tmp_path):
    """A slime that drops --eps-clip-c but whose call the patch does not fit (the form before #2067)."""
    plist = patches.load_patches()
    tree = make_tree(tmp_path, plist)
    loss = tree / probes.LOSS
    loss.write_text("def policy_loss_function(args, batch, logits, sum_of_sample_mean):\n"
                    "    pg_loss, pg_clipfrac = compute_policy_loss(ppo_kl, advantages, args.eps_clip, "
                    "args.eps_clip_high)\n    return pg_loss, pg_clipfrac\n")
    before = snapshot(tree)
    with pytest.raises(patches.PatchRefused) as e:
        patches.apply_patches(tree, log=lambda *_: None)
    msg = str(e.value)
    assert "0002-dual-clip-epsilon.patch does not fit" in msg and "without eps_clip_c" in msg
    assert "78156c53c" in msg and "nothing was changed" in msg
    assert snapshot(tree) == before


def test_hook_not_called_after_applying_is_refused(tmp_path):
    """The text applies, but the call lands in a method slime never runs per step: the probe stops it."""
    plist = patches.load_patches()
    tree = make_tree(tmp_path, plist)
    actor = tree / probes.ACTOR
    actor.write_text(actor.read_text().replace("    def train(self, rollout_id,", "    def train_unused(self, rollout_id,"))
    with pytest.raises(patches.PatchRefused, match="0001-after-train-hook.patch applied .* its check fails: "
                       "MegatronTrainRayActor has no train"):
        patches.apply_patches(tree, log=lambda *_: None)


def test_hook_call_after_an_early_return_does_not_count(tmp_path):
    tree = make_tree(tmp_path, patches.load_patches())
    patches.apply_patches(tree, log=lambda *_: None)
    actor = tree / probes.ACTOR
    text = actor.read_text()
    actor.write_text(text.replace("            result = None\n", "            result = None\n            return result\n", 1))
    ok, why = probes.hook_called(tree)
    assert not ok and "never calls self.after_train_hook" in why
    with pytest.raises(patches.PatchRefused, match="its check fails"):
        patches.verify_applied(tree)


def test_patched_file_that_does_not_compile_is_refused(tmp_path):
    tree = make_tree(tmp_path, patches.load_patches())
    patches.apply_patches(tree, log=lambda *_: None)
    args_py = tree / probes.ARGUMENTS
    args_py.write_text(args_py.read_text() + "\n    )\n")
    with pytest.raises(patches.PatchRefused, match="does not compile after patching"):
        patches.verify_applied(tree)


def test_probe_report_runs_as_a_standalone_program(tmp_path):
    """The preflight sends probes.py as `python3 -c` program text: it must run alone, stdlib only."""
    import json
    import sys

    tree = make_tree(tmp_path, patches.load_patches())
    _git(tree, "init", "-q")
    _git(tree, "add", ".")
    _git(tree, "commit", "-qm", "base")
    src = Path(probes.__file__).read_text()
    out = subprocess.run([sys.executable, "-I", "-c", src, "--tree", str(tree)], capture_output=True, text=True,
                         check=True, cwd=tmp_path)
    rep = json.loads(out.stdout)
    assert re.fullmatch(r"[0-9a-f]{40} \d{4}-\d\d-\d\d", rep["commit"]) and rep["is_slime"]
    assert {k: v[0] for k, v in rep["probes"].items()} == {n: False for n in probes.PROBES}


def test_box_check_reads_slimes_commit_not_an_enclosing_repositorys(tmp_path):
    from infra import box_check

    outer = tmp_path / "outer"
    tree = make_tree(outer, patches.load_patches())
    assert box_check.check_slime(str(tree))["commit"].startswith("unknown")  # no repository at all
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "outer"]):
        _git(outer, *args)
    assert box_check.check_slime(str(tree))["commit"].startswith("unknown")  # outer's commit is not slime's
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "slime"]):
        _git(tree, *args)
    sha = _git(tree, "rev-parse", "HEAD").strip()
    got = box_check.check_slime(str(tree))
    assert got["ok"] and got["commit"] == sha and re.fullmatch(r"\d{4}-\d\d-\d\d", got["date"])
    assert probes.slime_commit(tree).startswith(sha)
