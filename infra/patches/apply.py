"""Apply our slime patches (infra/patches/*.patch) to a slime tree, idempotently, and check they applied.

    python -m infra.patches.apply --tree /root/slime            # apply what is missing, verify all
    python -m infra.patches.apply --tree /root/slime --dry-run  # report only
More in docs/slime.md (module notes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from . import probes

PATCH_DIR = Path(__file__).resolve().parent
HEADER_FIELDS = ("Upstream:", "Fits:", "Need:", "Can go:")
#: a file every slime tree has; a tree without it is not slime
SLIME_MARKER = "slime/utils/arguments.py"

State = Literal["applied", "upstream", "applies", "applies-3way", "conflict"]
#: what each state means in a log line or the preflight's box.slime row
STATE_WORDS = {"applied": "already applied", "upstream": "not needed (slime already does it)",
               "applies": "to apply", "applies-3way": "to apply (3-way)", "conflict": "does not fit"}


class PatchRefused(RuntimeError):
    """The patch set does not fit this tree; nothing was changed."""


@dataclass(frozen=True)
class Patch:
    path: Path
    header: dict[str, str]

    @property
    def name(self) -> str:
        return self.path.name

    def probe(self, tree: Path) -> tuple[bool, str] | None:
        """The patch's probe on `tree` (infra/patches/probes.py), None for a patch without one."""
        fn = probes.PROBES.get(self.name)
        return None if fn is None else fn(tree)


def _header(path: Path) -> dict[str, str]:
    fields: dict[str, str] = {}
    current = None
    for line in path.read_text().splitlines():
        if line.startswith("diff --git "):
            break
        key = next((f for f in HEADER_FIELDS if line.startswith(f)), None)
        if key:
            current = key[:-1]
            fields[current] = line[len(key):].strip()
        elif current and line.startswith(" "):
            fields[current] += " " + line.strip()
    missing = [f[:-1] for f in HEADER_FIELDS if f[:-1] not in fields]
    if missing:
        raise ValueError(f"{path}: the patch header lacks {', '.join(missing)}; add them")
    return fields


def load_patches(directory: Path = PATCH_DIR) -> list[Patch]:
    """The patch set, in name order, each with its header."""
    return [Patch(p, _header(p)) for p in sorted(directory.glob("*.patch"))]


def _git(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # A ceiling at the tree's parent keeps git from treating an enclosing repository as the tree's own.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.resolve().parent), "LC_ALL": "C"}
    return subprocess.run(["git", *args], cwd=tree, env=env, capture_output=True, text=True, check=False)


def _is_git_checkout(tree: Path) -> bool:
    return _git(tree, "rev-parse", "--is-inside-work-tree").stdout.strip() == "true"


def tree_commit(tree: Path) -> str:
    """The tree's commit (`<sha> <date>`), or a note that it is not a git checkout."""
    if not _is_git_checkout(tree):
        return "not a git checkout"
    out = _git(tree, "log", "-1", "--format=%H %cs")
    return out.stdout.strip() or "unknown commit"


def _added_blocks(patch: Patch) -> dict[str, list[list[str]]]:
    """file -> the runs of lines the patch adds (each run contiguous in the patched file)."""
    blocks: dict[str, list[list[str]]] = {}
    current, run = None, []
    for line in patch.path.read_text().splitlines() + ["diff --git end"]:
        if line.startswith("+") and not line.startswith("+++ ") and current:
            run.append(line[1:])
            continue
        if run:
            blocks.setdefault(current, []).append(run)
            run = []
        if line.startswith("+++ b/"):
            current = line[len("+++ b/"):]
        elif line.startswith("diff --git"):
            current = None
    return blocks


def _holds_additions(tree: Path, patch: Patch) -> bool:
    """Every added run is in its file: true after a plain or a three-way apply (where the reverse check,
    which needs the patch's own context, can fail on drifted context)."""
    blocks = _added_blocks(patch)
    if not blocks:
        return False
    for rel, runs in blocks.items():
        f = tree / rel
        if not f.is_file():
            return False
        text = "\n" + f.read_text()
        if not all("\n" + "\n".join(r) + "\n" in text for r in runs):
            return False
    return True


def patch_state(tree: Path, patch: Patch) -> tuple[State, str]:
    """Where `patch` stands on `tree`, with git's message when it does not fit."""
    if _git(tree, "apply", "--check", "--reverse", str(patch.path)).returncode == 0:
        return "applied", ""
    if _holds_additions(tree, patch):
        return "applied", ""
    probe = patch.probe(tree)
    if probe is not None and probe[0]:
        return "upstream", probe[1]
    plain = _git(tree, "apply", "--check", str(patch.path))
    if plain.returncode == 0:
        return "applies", ""
    if _is_git_checkout(tree):
        three = _git(tree, "apply", "--3way", "--check", str(patch.path))
        text = three.stdout + three.stderr
        if three.returncode == 0 and "with conflicts" not in text:
            return "applies-3way", ""
    return "conflict", plain.stderr.strip()


def check_slime_tree(tree: Path) -> None:
    if not (tree / SLIME_MARKER).is_file():
        raise PatchRefused(f"{tree} is not a slime checkout (no {SLIME_MARKER}); pass --tree /path/to/slime")


def apply_patches(tree: str | Path, *, dry_run: bool = False, patches: list[Patch] | None = None,
                  log=print) -> dict[str, State]:
    """Bring `tree` to "every patch applied"; returns each patch's state before this call."""
    tree = Path(tree)
    check_slime_tree(tree)
    patches = load_patches() if patches is None else patches
    states = {p.name: patch_state(tree, p) for p in patches}
    refused = [(p, msg) for p in patches for st, msg in [states[p.name]] if st == "conflict"]
    if refused:
        lines = [f"refusing to patch {tree} ({tree_commit(tree)}); nothing was changed:"]
        for p, msg in refused:
            lines.append(f"  {p.name} does not fit this tree. It fits {p.header['Upstream']} at {p.header['Fits']}")
            probe = p.probe(tree)
            if probe is not None:
                lines.append(f"    needed here: {probe[1]}; it can go {p.header['Can go']}")
            lines += [f"    git: {m}" for m in msg.splitlines()[:6]]
        lines.append("Fix: use a slime commit the patch fits, or one where it is not needed "
                     "(cd <slime> && git checkout <commit>), or an image whose /root/slime is one.")
        raise PatchRefused("\n".join(lines))
    for p in patches:
        st = states[p.name][0]
        if st in ("applied", "upstream"):
            log(f"patch {p.name}: {STATE_WORDS[st]}" + (f": {states[p.name][1]}" if st == "upstream" else ""))
            continue
        if dry_run:
            log(f"patch {p.name}: would apply ({st}) [dry run]")
            continue
        res = _git(tree, "apply", *(["--3way"] if st == "applies-3way" else []), str(p.path))
        if res.returncode != 0:
            raise PatchRefused(f"patch {p.name} failed to apply to {tree}: {res.stderr.strip()}")
        log(f"patch {p.name}: applied{' (3-way)' if st == 'applies-3way' else ''}")
    if not dry_run:
        verify_applied(tree, patches)
    return {name: st for name, (st, _) in states.items()}


def _patched_files(patch: Patch) -> list[str]:
    return [line[len("+++ b/"):] for line in patch.path.read_text().splitlines() if line.startswith("+++ b/")]


def verify_applied(tree: str | Path, patches: list[Patch] | None = None) -> None:
    """Raise unless every patch is in the tree (or not needed there), each patched Python file compiles,
    and each patch's probe holds: the behaviour is there, not only the text."""
    tree = Path(tree)
    for p in load_patches() if patches is None else patches:
        state = patch_state(tree, p)[0]
        if state not in ("applied", "upstream"):
            raise PatchRefused(f"patch {p.name} is not applied to {tree} after applying it; inspect the tree")
        for rel in _patched_files(p) if state == "applied" else []:
            if rel.endswith(".py") and (tree / rel).is_file():
                try:
                    compile((tree / rel).read_text(), str(tree / rel), "exec")
                except SyntaxError as e:
                    raise PatchRefused(f"patch {p.name}: {rel} does not compile after patching ({e}); "
                                       "inspect the tree") from None
        probe = p.probe(tree)
        if probe is not None and not probe[0]:
            raise PatchRefused(f"patch {p.name} applied to {tree} but its check fails: {probe[1]}; "
                               "inspect the tree (a local edit may have moved the call)")


#: what a state before the patch step became after it
DONE_WORDS = {**STATE_WORDS, "applies": "applied", "applies-3way": "applied (3-way)"}


def summary(states: dict[str, State], *, done: bool = True) -> str:
    """One line for the launch log and the preflight: each patch and what the patch step did (`done`) or
    would do with the states found before it."""
    words = DONE_WORDS if done else STATE_WORDS
    return "; ".join(f"{name.removesuffix('.patch')}: {words[st]}" for name, st in states.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default="/root/slime", help="the slime checkout (default /root/slime)")
    ap.add_argument("--dry-run", action="store_true", help="report what would be applied; change nothing")
    args = ap.parse_args(argv)
    if not (Path(args.tree) / SLIME_MARKER).is_file():  # bad input (2), where a patch that does not fit is a check (1)
        print(f"--tree {args.tree} is not a slime checkout (no {SLIME_MARKER}); pass --tree /path/to/slime",
              file=sys.stderr)
        return 2
    try:
        apply_patches(args.tree, dry_run=args.dry_run)
    except (PatchRefused, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
