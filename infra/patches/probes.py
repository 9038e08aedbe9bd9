"""Does a slime tree do what each of our patches is for? Read off slime's code (its syntax tree), not its date.

One probe per patch, each `probe(tree) -> (True/False, why)`:
  * before applying, a probe that already holds means upstream slime does it: the patch is not needed;
  * after applying, the probe must hold, or the text applied but the behaviour is not there (a hook
    defined and never called, a value parsed and never passed on), and the patch step stops.

Standard library only: the preflight sends this file as the program text of `python3 -c` to the box
(`python3 probes.py --tree /root/slime` prints one JSON object: slime's commit and each probe's verdict).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ACTOR = "slime/backends/megatron_utils/actor.py"
ARGUMENTS = "slime/utils/arguments.py"
LOSS = "slime/backends/megatron_utils/loss.py"
HOOK_FLAG = "--custom-after-train-hook-path"


def _parse(tree: Path, rel: str) -> ast.Module | None:
    try:
        return ast.parse((Path(tree) / rel).read_text(), filename=rel)
    except (OSError, SyntaxError, ValueError):
        return None


def _attr_chain(node: ast.AST) -> str:
    """`self.args.x` -> "self.args.x" (empty for anything that is not a plain name/attribute chain)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _calls(node: ast.AST, chain: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and _attr_chain(n.func) == chain]


def _stmt_lists(node: ast.AST):
    """Every statement list (bodies, else branches, handlers) under `node`."""
    for n in ast.walk(node):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(n, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((f for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name == name),
                None)


def hook_called(tree: str | Path) -> tuple[bool, str]:
    """Patch 0001: slime parses --custom-after-train-hook-path, loads the function it names, and the train
    actor calls it with (args, rollout_id, model) after train_actor, on the path every policy update takes."""
    args_mod = _parse(tree, ARGUMENTS)
    if args_mod is None:
        return False, f"{ARGUMENTS} is missing or does not parse"
    flags = [c for c in _calls(args_mod, "parser.add_argument")
             if c.args and isinstance(c.args[0], ast.Constant) and c.args[0].value == HOOK_FLAG]
    if not flags:
        return False, f"slime's parser has no {HOOK_FLAG}"
    actor_mod = _parse(tree, ACTOR)
    if actor_mod is None:
        return False, f"{ACTOR} is missing or does not parse"
    cls = next((c for c in ast.walk(actor_mod) if isinstance(c, ast.ClassDef) and c.name == "MegatronTrainRayActor"),
               None)
    if cls is None:
        return False, f"{ACTOR} has no class MegatronTrainRayActor"
    loads = [a for a in ast.walk(cls) if isinstance(a, ast.Assign)
             and any(_attr_chain(t) == "self.after_train_hook" for t in a.targets)
             and isinstance(a.value, ast.Call) and _attr_chain(a.value.func) == "load_function"
             and any(_attr_chain(x).endswith("args.custom_after_train_hook_path") for x in a.value.args)]
    if not loads:
        return False, "MegatronTrainRayActor never loads --custom-after-train-hook-path into self.after_train_hook"
    train = _method(cls, "train")
    if train is None:
        return False, "MegatronTrainRayActor has no train() method"
    for block in _stmt_lists(train):
        trained = [i for i, s in enumerate(block) if _calls(s, "self.train_actor")]
        if not trained:
            continue
        for s in block[trained[0] + 1:]:
            if isinstance(s, ast.Return | ast.Raise):
                break
            for call in _calls(s, "self.after_train_hook"):
                if [_attr_chain(a) for a in call.args] == ["self.args", "rollout_id", "self.model"]:
                    return True, (f"MegatronTrainRayActor.train calls self.after_train_hook(self.args, rollout_id, "
                                  f"self.model) after train_actor ({ACTOR} line {call.lineno})")
    return False, "MegatronTrainRayActor.train never calls self.after_train_hook(args, rollout_id, model) after train_actor"


def dual_clip_forwarded(tree: str | Path) -> tuple[bool, str]:
    """Patch 0002: slime's policy loss passes --eps-clip-c to compute_policy_loss (upstream since 78156c53c)."""
    mod = _parse(tree, LOSS)
    if mod is None:
        return False, f"{LOSS} is missing or does not parse"
    fn = next((f for f in ast.walk(mod) if isinstance(f, ast.FunctionDef) and f.name == "policy_loss_function"), None)
    if fn is None:
        return False, f"{LOSS} has no policy_loss_function"
    calls = _calls(fn, "compute_policy_loss")
    if not calls:
        return False, "policy_loss_function does not call compute_policy_loss"
    dropped = [c.lineno for c in calls if len(c.args) < 5 and not any(
        k.arg == "eps_clip_c" and _attr_chain(k.value) == "args.eps_clip_c" for k in c.keywords)]
    if dropped:
        return False, (f"policy_loss_function calls compute_policy_loss without eps_clip_c ({LOSS} line "
                       f"{dropped[0]}): --eps-clip-c is parsed and ignored, dual-clip PPO is off")
    return True, f"policy_loss_function passes args.eps_clip_c to compute_policy_loss ({LOSS} line {calls[0].lineno})"


#: patch file -> its probe (every patch of ours has one; tests check that)
PROBES = {
    "0001-after-train-hook.patch": hook_called,
    "0002-dual-clip-epsilon.patch": dual_clip_forwarded,
}
#: patch file -> the files it changes (where its "stoa patch NNNN" comment lands)
FILES = {"0001-after-train-hook.patch": (ACTOR, ARGUMENTS), "0002-dual-clip-epsilon.patch": (LOSS,)}


def marked(tree: str | Path, name: str) -> bool:
    """True when our patch's comment (`stoa patch NNNN`) is in one of the files it changes."""
    mark = f"stoa patch {name[:4]}"
    for rel in FILES.get(name, ()):
        try:
            if mark in (Path(tree) / rel).read_text():
                return True
        except OSError:
            pass
    return False


def verdict(tree: str | Path, name: str) -> tuple[str, str]:
    """("patched" | "upstream" | "to apply" | "broken", why) for one patch on `tree`, from its probe and mark:
    broken is our patch's text in place with the behaviour missing."""
    ok, why = PROBES[name](tree)
    if marked(tree, name):
        return ("patched" if ok else "broken"), why
    return ("upstream" if ok else "to apply"), why


def slime_commit(tree: str | Path) -> str:
    """`<sha> <date>` of the slime checkout, or why it is not known."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(Path(tree).resolve().parent)}  # not an enclosing repo's
    res = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%H %cs"], capture_output=True, text=True,
                         env=env, check=False)
    return res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else "unknown (not a git checkout)"


def report(tree: str | Path) -> dict:
    """slime's commit and every probe's verdict on `tree`."""
    return {"commit": slime_commit(tree), "is_slime": (Path(tree) / ARGUMENTS).is_file(),
            "probes": {name: list(fn(tree)) for name, fn in PROBES.items()},
            "verdicts": {name: list(verdict(tree, name)) for name in PROBES}}


if __name__ == "__main__":
    _tree = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv else "/root/slime"
    print(json.dumps(report(_tree)))
