"""`python -m bench.embedded_run --recipe gsm8k`: the embedded run a new user starts with `make gsm8k`, as a
result file: the held-out curve, steps and wall time, the machine's load, and the run's raw logs beside it.

It runs exactly what the Makefile runs (`python -m entrypoints.launch --recipe R --run ID`, a fresh run id),
then reads the run's own metrics.jsonl; nothing of the run is re-implemented here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench import common

REPO = Path(__file__).resolve().parent.parent


def summarise(rows: list[dict]) -> dict:
    """The held-out curve (rows with eval/accuracy) and the learner's steps, from metrics.jsonl rows."""
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "eval/accuracy" not in r and isinstance(r.get("step"), int)]
    acc = [r["eval/accuracy"] for r in evals]
    out = {"steps": max((r["step"] for r in steps), default=0), "evals": evals}
    if acc:
        out.update(heldout_first=acc[0], heldout_last=acc[-1], heldout_best=max(acc),
                   heldout_mean_last3=round(sum(acc[-3:]) / len(acc[-3:]), 4))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.embedded_run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=["gsm8k", "psqa"], default="gsm8k")
    parser.add_argument("--run", default=None, help="run id (default: bench-<recipe>-<unix time>, always fresh)")
    parser.add_argument("--worker", choices=["torch", "mlx"], default="torch", help="the local workers' backend")
    parser.add_argument("--out", default=None, help="result file (default bench/results/embedded_<recipe>_cpu.json)")
    args = parser.parse_args(argv)
    run = args.run or f"bench-{args.recipe}-{int(time.time())}"
    out = Path(args.out or common.RESULTS / f"embedded_{args.recipe}_cpu.json")
    launch = [sys.executable, "-m", "entrypoints.launch", "--recipe", args.recipe, "--run", run,
              "--worker", args.worker]
    tree = common.provenance()  # the code that runs; the checkout may move on while it does
    load_before = os.getloadavg()
    t0 = time.monotonic()
    console = subprocess.run(launch, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - t0
    run_dir = REPO / ".stoa" / "runs" / run
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    raw_metrics = out.with_name(out.stem + "_metrics.jsonl")
    raw_logs = out.with_name(out.stem + "_logs.txt")
    if metrics.exists():
        shutil.copyfile(metrics, raw_metrics)
    logs = [f"== console (exit {console.returncode})\n{console.stdout}\n{console.stderr}"]
    logs += [f"== {p.name}\n{p.read_text(errors='replace')}" for p in sorted(run_dir.glob("*.log"))]
    raw_logs.write_text("\n".join(logs))
    result = {"recipe": args.recipe, "worker": args.worker, "run": run, "exit_code": console.returncode,
              "wall_s": round(wall, 1), "load_before": load_before, "load_after": os.getloadavg(),
              **summarise(rows), "raw": [raw_metrics.name, raw_logs.name]}
    common.write_result(f"embedded_{args.recipe}_cpu", result, out, argv=argv if argv is not None else sys.argv[1:],
                        module="bench.embedded_run", tree=tree)
    print(f"{out}: held-out {result.get('heldout_first')} -> {result.get('heldout_last')} "
          f"(best {result.get('heldout_best')}) in {result['steps']} steps, {wall:.0f} s, exit {console.returncode}")
    return 0 if console.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
