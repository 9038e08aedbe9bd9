"""How long our processes take to start: every CLI call, worker, learner actor and test subprocess pays it.

    python -m bench.startup [--runs 7] [--ml-dtypes DIR ...] [--out bench/results/startup.json]
    python -m bench startup   (the same with its defaults, as `nox -s bench` runs it)

Each command runs `--runs` times in turn with the others (interleaved, so a busy moment hits all alike);
the result keeps min, median and max wall seconds. `--ml-dtypes DIR` (a `pip install --target DIR
ml_dtypes==X` folder) adds `import ml_dtypes` from that folder beside the installed one: the side-by-side
figure behind the `ml_dtypes<0.7` pin in pyproject.toml (docs/performance.md, "Process start-up").
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from worker_contract.cli import number

from .common import write_result

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

#: name -> (argv, extra environment); what a user or the suite starts most often
COMMANDS = {
    "python": ([sys.executable, "-c", "pass"], {}),
    "import ml_dtypes": ([sys.executable, "-c", "import ml_dtypes"], {}),
    "import worker_contract.tensors": ([sys.executable, "-c", "import worker_contract.tensors"], {}),
    "import trainer.config": ([sys.executable, "-c", "import trainer.config"], {}),
    "invoke --list": ([str(BIN / "invoke"), "--list"], {}),
    "python -m entrypoints.launch --help": ([sys.executable, "-m", "entrypoints.launch", "--help"], {}),
    "DRL_DRY_RUN=1 python -m entrypoints.launch --recipe gsm8k": (
        [sys.executable, "-m", "entrypoints.launch", "--recipe", "gsm8k", "--run", "bench-startup"],
        {"DRL_DRY_RUN": "1"}),
    "python -m worker_contract.worker --help": ([sys.executable, "-m", "worker_contract.worker", "--help"], {}),
}


def _ml_dtypes_version(env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", "import ml_dtypes; print(ml_dtypes.__version__)"], env=env,
                          capture_output=True, text=True, cwd=REPO).stdout.strip()


def time_process(argv: list[str], env: dict[str, str] | None = None) -> float:
    """Wall seconds of one fresh process running `argv` to a zero exit (its output discarded)."""
    t = time.perf_counter()
    subprocess.run(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=number(int, at_least=1), default=7, help="runs of each command (default 7)")
    parser.add_argument("--ml-dtypes", type=Path, action="append", default=[], metavar="DIR",
                        help="a folder holding another ml_dtypes (pip install --target DIR ml_dtypes==X)")
    parser.add_argument("--out", type=Path, default=None, help="result file (default bench/results/startup.json)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs {args.runs} must be at least 1")
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cases = {name: (cmd, {**base, **extra}) for name, (cmd, extra) in COMMANDS.items()}
    versions = {"installed": _ml_dtypes_version(base)}
    for folder in args.ml_dtypes:
        if not (folder / "ml_dtypes").is_dir():
            parser.error(f"--ml-dtypes {folder}: no ml_dtypes package in it (pip install --target {folder} "
                         "ml_dtypes==X)")
        env = {**base, "PYTHONPATH": str(folder.resolve())}
        version = _ml_dtypes_version(env)
        versions[str(folder)] = version
        cases[f"import ml_dtypes {version} ({folder.name})"] = (COMMANDS["import ml_dtypes"][0], env)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(args.runs):
        for name, (cmd, env) in cases.items():
            times[name].append(time_process(cmd, env))
        print(f"run {i + 1}/{args.runs}", flush=True)
    rows = {name: {"min_s": round(min(t), 4), "median_s": round(statistics.median(t), 4),
                   "max_s": round(max(t), 4)} for name, t in times.items()}
    width = max(map(len, rows))
    for name, row in rows.items():
        print(f"{name:<{width}}  median {row['median_s']:.3f} s  (min {row['min_s']:.3f}, max {row['max_s']:.3f})")
    out = write_result("startup", {"runs": args.runs, "ml_dtypes": versions, "wall_s": rows}, path=args.out,
                       argv=argv, module="bench.startup")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
