"""`python -m bench.fleet` / `nox -s fleet`: hundreds of simulated workers against moto's S3 server on
127.0.0.1 behind our fault proxy with R2-like latency, faults and a rate cap; one learner (the real
rollout source and publisher around a stand-in step). Figures in bench/results/fleet.json.

    spec.py        what a run is (workers, kinds, pace, wire, learner)    wire.py     moto, proxy, counters
    workers.py     simulated workers on the real contract                 learner.py  the learner stand-in
    run.py         one run, end to end                                    accounting.py  exactly-once check
    figures.py     the figures and the R2 bill                            cli.py      scenarios, results file
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from .cli import main as cli_main

    return cli_main(argv)
