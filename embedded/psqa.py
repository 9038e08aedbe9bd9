"""The embedded psqa run's own pieces (`make psqa RUN=<id>` with no HOST, GPU or R2), around embedded/run.py.

    PsqaServices    the generated corpus (embedded/psqa_synth.py), the real retriever service on 127.0.0.1
                    (`python -m infra.retriever serve`, a child process started first and stopped last), the
                    base (embedded/psqa_base.py, or MODEL=), the workers' search flags and environment
    PsqaHeldoutEvaluator   held-out cover-EM pass@1, search rate and the share of correct answers found after a
                    search, through trainer/psqa_eval.py's `evaluate` on test questions never trained on
More in docs/embedded.md (module notes).
"""

from __future__ import annotations

import shlex
import shutil
import socket
import time
from pathlib import Path

from infra.retriever import serve_argv

from .config import EmbeddedRecipe
from .heldout import HeldoutEvaluator
from .localprocs import Processes, child_env


def data_dir(cfg: EmbeddedRecipe, paths) -> Path:
    from .psqa_synth import GENERATOR_VERSION  # another generator writes other bytes: another cache dir

    p = cfg.embedded.psqa
    return paths.cache / f"psqa-data-g{GENERATOR_VERSION}-{p.entities}-{p.heldout_entities}-{p.seed}"


def ensure_data(cfg: EmbeddedRecipe, paths) -> Path:
    """corpus.jsonl / train.jsonl / test.jsonl, written once (seeded, the same bytes on every machine)."""
    from .psqa_synth import write_dataset

    out = data_dir(cfg, paths)
    if not (out / "test.jsonl").exists():
        p = cfg.embedded.psqa
        tmp = out.with_name(out.name + f".tmp-{time.time_ns()}")
        write_dataset(tmp, n_entities=p.entities, heldout_entities=p.heldout_entities, seed=p.seed)
        try:
            tmp.rename(out)
        except OSError:  # another launcher wrote it first: the same bytes
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the retriever binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def worker_flags(cfg: EmbeddedRecipe, url: str) -> list[str]:
    p = cfg.embedded.psqa
    return ["--retriever-url", url, "--retriever-tier", p.retriever_tier, "--max-turns", str(p.max_turns)]


def worker_env(cfg: EmbeddedRecipe, url: str, data: Path) -> dict[str, str]:
    """What a psqa worker adds to the local workers' environment: the contract's KV mode, the retriever, the data."""
    return {"DRL_KV_MODE": cfg.contract.kv_mode or "paged_prefix", "DRL_RETRIEVER_URL": url,
            "DRL_PSQA_DIR": str(data)}


def build_base(cfg: EmbeddedRecipe, paths, data: Path, search, console) -> Path:
    """The one call to embedded/psqa_base.py: the small LFM2-MoE supervised into the search format (cached)."""
    from .psqa_base import PsqaBaseConfig, ensure_psqa_base

    model_dir, report = ensure_psqa_base(data, paths.cache, search, cfg=PsqaBaseConfig(**cfg.embedded.psqa.base),
                                         log=console.print, show_progress=True)
    e = cfg.embedded
    console.print(f"base model {model_dir}: {report.params / 1e6:.2f} M parameters, held-out cover-EM "
                  f"{100 * report.pass1:.1f}%, search rate {100 * report.search_rate:.0f}% (as built: "
                  f"{report.heldout_questions} questions, 4 samples each at temperature 1; the run's own base "
                  f"figure scores v1, these weights in the {cfg.contract.plane} plane, on {e.eval_problems} "
                  f"questions, {e.psqa.eval_k} sample{'s' if e.psqa.eval_k > 1 else ''} each, "
                  f"{'greedy' if e.eval_temperature is None else f'at temperature {e.eval_temperature:g}'})")
    return Path(model_dir)


class PsqaServices:
    """The data and the retriever of one embedded psqa session; `stop` after every other child has stopped."""

    def __init__(self, cfg: EmbeddedRecipe, paths):
        self.cfg, self.paths = cfg, paths
        self.procs = Processes(record=paths.run_dir)
        self.data: Path | None = None
        self.url: str | None = None

    def start(self, console, timeout_s: float = 120.0) -> None:
        from worker_contract.tasks.psqa_retrieval import RetrieverClient, RetrieverError

        self.data = ensure_data(self.cfg, self.paths)
        port = free_port()
        child = self.procs.start("retriever", serve_argv(self.data / "corpus.jsonl", port), child_env(self.cfg),
                                 self.paths.run_dir / "retriever.log")
        self.url = f"http://127.0.0.1:{port}"
        client, deadline = RetrieverClient(self.url, timeout_s=2.0, retries=0), time.monotonic() + timeout_s
        while True:
            try:
                docs = client.health().documents
                break
            except RetrieverError:
                if not child.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the retriever did not come up at {self.url}:\n{child.tail()}") from None
                time.sleep(0.3)
        console.print(f"retriever {self.url}: {docs} generated abstracts (log {child.log})")

    def search(self, k: int = 3):
        from worker_contract.tasks.psqa_retrieval import RetrieverClient, search_tool

        return search_tool(RetrieverClient(self.url), k=k, strict=True)

    def prepare_model(self, cfg: EmbeddedRecipe, console) -> tuple[EmbeddedRecipe, Path]:
        if cfg.model.path:
            return cfg, Path(cfg.model.path)
        model_dir = build_base(cfg, self.paths, self.data, self.search(), console)
        return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(model_dir)})}), model_dir

    def task(self):
        from worker_contract.tasks.psqa import PsqaTask

        return PsqaTask(str(self.data))

    def evaluator(self, cfg: EmbeddedRecipe, store, model_dir: Path) -> PsqaHeldoutEvaluator:
        e = cfg.embedded
        return PsqaHeldoutEvaluator(store, cfg.run, cfg.contract.plane, model_dir, self.task(),
                                    problems=e.eval_problems, max_new_tokens=cfg.algo.max_new_tokens,
                                    temperature=e.eval_temperature, metrics_path=self.paths.metrics,
                                    search=self.search(e.psqa.top_k), k=e.psqa.eval_k, max_turns=e.psqa.max_turns,
                                    out_dir=self.paths.run_dir / "plots")

    def worker_flags(self) -> list[str]:
        return worker_flags(self.cfg, self.url)

    def env(self) -> dict[str, str]:
        """The psqa variables of every child (learner and workers)."""
        return worker_env(self.cfg, self.url, self.data)

    def stop(self) -> None:
        self.procs.stop(timeout_s=10.0)


class PsqaHeldoutEvaluator(HeldoutEvaluator):
    """HeldoutEvaluator (a verified join, float32 on the CPU) scoring search episodes with psqa_eval.evaluate;
    each point also goes to <out_dir>/psqa_eval.jsonl and its curve to psqa_eval.png."""

    def __init__(self, *args, search, k: int, max_turns: int, out_dir: Path, seed: int = 0, **kw):
        super().__init__(*args, **kw)
        from trainer.psqa_eval import heldout_subset

        self.problems = heldout_subset(self.task.dataset("test"), len(self.problems), seed)
        self.search, self.k, self.max_turns, self.out_dir, self.seed = search, k, max_turns, Path(out_dir), seed

    def _score(self) -> dict:
        from trainer.psqa_eval import append_point, evaluate_policy, plot_curve

        temperature = self.temperature if self.temperature is not None else 1e-4  # None: (near) greedy
        point = evaluate_policy(self._policy, self._rec.version, self.problems, self.task, self.search, k=self.k,
                                max_new_tokens=self.max_new_tokens, max_turns=self.max_turns,
                                temperature=temperature, seed=self.seed)
        append_point(self.out_dir, point)
        plot_curve(self.out_dir)
        return {"eval/accuracy": point.pass1, "eval/search_rate": point.search_rate,
                "eval/correct_after_search": point.correct_after_search, "eval/pass_k": point.pass_k,
                "eval/searches_per_episode": point.searches_per_episode,
                "eval/response_tokens": point.response_tokens}


def plan_lines(cfg: EmbeddedRecipe, paths, middle: list[str], tail: list[str]) -> list[str]:
    """What the embedded psqa run will do, for the dry run (`middle`: embedded/run.py's run.json, learner and
    worker lines; `tail`: its stop and metrics lines)."""
    p, e = cfg.embedded.psqa, cfg.embedded
    data = data_dir(cfg, paths)
    base = (f"use the model at {cfg.model.path} (MODEL=)" if cfg.model.path else
            f"build and cache (or reuse) the base under {paths.cache}/psqa-base-<digest>: embedded.psqa_base."
            f"ensure_psqa_base, a small LFM2-MoE supervised into the search format "
            f"(PsqaBaseConfig{'(' + ', '.join(f'{k}={v!r}' for k, v in p.base.items()) + ')' if p.base else ' defaults'})")
    serve = shlex.join(["python", *map(str, serve_argv(data / "corpus.jsonl", 0)[1:])]).replace(
        "--port 0", "--port <a free port>")
    return [
        "mode: embedded (no HOST; no CUDA GPU with R2 credentials or DRL_STORE): the PaperSearchQA miniature on this "
        "machine",
        f"0. data {data}: {'reuse' if (data / 'test.jsonl').exists() else 'write'} the generated corpus "
        f"(embedded.psqa_synth.write_dataset: {p.entities} abstracts, {p.heldout_entities} entities held out)",
        f"0. retriever: {serve}   (log {paths.run_dir}/retriever.log; started first, stopped last; its URL is "
        "DRL_RETRIEVER_URL)",
        f"1. {base}",
        *middle,
        f"   every worker: {' '.join(worker_flags(cfg, '<retriever URL>'))}   "
        f"(DRL_KV_MODE={cfg.contract.kv_mode} DRL_RETRIEVER_URL=<retriever URL> DRL_PSQA_DIR={data})",
        f"5. held-out evaluation every {e.eval_every} steps: cover-EM pass@1 (k={p.eval_k}, temperature "
        f"{e.eval_temperature}), search rate and correct answers found after a search, on {e.eval_problems} test "
        f"questions (trainer.psqa_eval.evaluate, at most {p.max_turns} searches of top {p.top_k}), in this process; "
        f"curve {paths.run_dir}/plots/psqa_eval.png",
        *tail,
    ]
