"""`python -m bench.soak_doc`: docs/reliability.md's soak figures, written from bench/results/soak.json.

The section between the two markers is generated, never typed: after `nox -s soak` this rewrites it, and
tests/test_bench_results.py fails when the doc and the file disagree (`--check` does the same here).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOAK = REPO / "bench" / "results" / "soak.json"
DOC = REPO / "docs" / "reliability.md"
BEGIN = "<!-- soak figures: written by `python -m bench.soak_doc` from bench/results/soak.json; do not edit -->"
END = "<!-- end of the soak figures -->"


def _reasons(reasons: dict) -> str:
    return "; ".join(f"{k} {v:,}" for k, v in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))


def render(doc: dict) -> str:
    """The figures section for one soak.json document."""
    s, session = doc["sections"], doc.get("session", {})
    crash, store, kills, fuzz = s["crash"], s["store_faults"], s["worker_kills"], s["fuzz"]
    machine = doc.get("machine", {})
    wall = int(session.get("wall_s", 0))
    clean = {True: "a clean tree", False: "a tree with uncommitted changes"}.get(doc.get("clean"), "a tree whose "
                                                                                   "state was not recorded")
    phases = ", ".join(sorted(crash["targeted"]))
    landed = sum(crash["landed"].values())
    left = crash["left_behind"]
    by_kind = ", ".join(f"{v} x {k}" for k, v in sorted(store["by_kind"].items()))
    lines = [
        BEGIN,
        f"`{session.get('command', doc.get('command'))}` ({session.get('trials', crash['trials'])} trials), "
        f"{wall // 60} min {wall % 60} s on {machine.get('cpu', 'an unrecorded CPU')} "
        f"({machine.get('cpus', machine.get('cores', '?'))} cores), code at commit {str(doc['commit'])[:7]} "
        f"({clean}), started {doc.get('started_at', '?')}. Source: `bench/results/soak.json`.",
        "",
        "| | figures |",
        "|---|---|",
        f"| crash | {crash['kills']} SIGKILLs of the trainer's whole process tree, aimed at each phase ({phases}: "
        f"{', '.join(f'{v} {k}' for k, v in sorted(crash['targeted'].items()))}), {landed} seen inside their phase "
        f"right before the kill; {left.get('partial_checkpoint', 0)} left a half-written checkpoint and "
        f"{left.get('unfinished_publish', 0)} an unfinished publish behind. {crash['steps']} learner steps along "
        f"the surviving lineage; the pointer reached v{crash['versions']} (every restart anchors at a fresh "
        f"version), {crash['skipped_versions']} versions skipped. A concurrent reader read the pointer "
        f"{crash['pointer_reads']:,} times and followed {crash['followed_versions']} versions. "
        f"{crash['groups_used']} groups used, none more than {crash['max_uses']} times (the cap is "
        f"{crash['reuse_cap']}) |",
        f"| store faults | {store['trials']} runs, {store['requests']:,} requests, {store['faults']} faults injected "
        f"({100 * store['faults'] / max(store['requests'], 1):.1f}%): {by_kind}. {store['learner_steps']} learner "
        f"steps, {store['versions_published']} versions published, {store['verify_failures']} verify failures; a "
        f"concurrent reader read {store['reader_reads']:,} objects and saw {store['partial_objects_seen']} partial |",
        f"| worker kills | {kills['file']['trials']} workers on a file bucket killed while their upload's temporary "
        f"file existed ({kills['file']['records_visible']} records landed whole, {kills['tmp_files_left_invisible']} "
        f"temporary files left that no reader lists), {kills['s3']['trials']} on S3 killed while their PUT was in "
        f"flight ({kills['s3']['records_visible']} records whole); {kills['partial_objects_visible']} partial "
        f"objects visible |",
        f"| bad input | {fuzz['records']:,} records ({fuzz['trials']} trials): {fuzz['hostile_dropped']:,} hostile "
        f"ones dropped ({_reasons(fuzz['reasons'])}), {fuzz['controls_accepted']} valid controls accepted and "
        f"trained on; {fuzz['learner_crashes']} learner crashes; peak RSS growth at most "
        f"{fuzz['peak_rss_growth_mb_max']} MB, {fuzz['retained_rss_mb_max']} MB retained after; "
        f"{fuzz['poll_s_mean']} s to read {fuzz['records'] // max(fuzz['trials'], 1):,} records |",
        END,
    ]
    return "\n".join(lines)


def rewrite(doc_text: str, section: str) -> str:
    """The doc with its generated section replaced (the markers must be there once each)."""
    if doc_text.count(BEGIN) != 1 or doc_text.count(END) != 1:
        raise ValueError(f"{DOC.name} must hold the soak markers once each ({BEGIN!r} ... {END!r})")
    head, rest = doc_text.split(BEGIN)
    return head + section + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak_doc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only say whether the doc matches the file (exit 1 if not)")
    args = parser.parse_args(argv)
    text = DOC.read_text()
    wanted = rewrite(text, render(json.loads(SOAK.read_text())))
    if args.check:
        print("docs/reliability.md matches bench/results/soak.json" if wanted == text else
              "docs/reliability.md's soak figures differ from bench/results/soak.json: run python -m bench.soak_doc")
        return 0 if wanted == text else 1
    DOC.write_text(wanted)
    print(f"wrote the soak figures of {DOC.relative_to(REPO)} from {SOAK.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
