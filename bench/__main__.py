"""`python -m bench [name ...]`: run the benchmarks (all by default); each writes bench/results/<name>.json.

A benchmark is a module in this package with `main(argv) -> int`, listed in BENCHMARKS. GPU-only ones
(pulse_gpu) are listed separately and run only when named, on a CUDA machine.
"""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARKS = {"pulse": "bench.pulse_bench", "mlx_worker": "bench.mlx_worker", "startup": "bench.startup"}
GPU_BENCHMARKS = {"pulse_gpu": "bench.pulse_gpu"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: {', '.join(BENCHMARKS)}; "
                        f"GPU only: {', '.join(GPU_BENCHMARKS)})")
    args = parser.parse_args(argv)
    known = {**BENCHMARKS, **GPU_BENCHMARKS}
    names = args.names or list(BENCHMARKS)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    rc = 0
    for name in names:
        print(f"== bench {name}", flush=True)
        rc |= importlib.import_module(known[name]).main([])
    return rc


if __name__ == "__main__":
    sys.exit(main())
