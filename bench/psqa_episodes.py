"""`python -m bench.psqa_episodes`: psqa search episodes on both workers (CPU): prefill tokens fed with the
paged_prefix caches (the prompt once per group, each sample extended after a tool turn) against re-prefilling
every turn's context from the start, and how close each sampled log-prob is to a cache-free recomputation
by torch and by MLX. Tiny random LFM2-MoE of the tests (tests/episode_fixtures.py), the psqa prompt, the
real BM25 retriever on 127.0.0.1 over a generated corpus; bench/results/psqa_episodes.json."""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

from worker_contract.cli import number


def _fresh(tp, mp, prompt, response):
    import mlx.core as mx
    import numpy as np
    import torch

    with torch.no_grad():
        lg = tp.model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    t = torch.log_softmax(lg, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()
    lg = mp.model(mx.array([prompt + response]))[0, len(prompt) - 1:-1].astype(mx.float32)
    lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
    return t, np.array(mx.take_along_axis(lp, mx.array(response)[:, None], axis=-1)[:, 0])


def search_setup(prefix: str, arch: str):
    """The tiny search model of the tests saved in a fresh temporary folder, its weights on the bf16 plane, and
    a search tool over the real BM25 retriever serving a generated corpus on 127.0.0.1: (model dir, bf16 state,
    search, server; the caller shuts the server down)."""
    from transformers import AutoModelForCausalLM

    from infra.retriever.corpus import synthetic_corpus
    from infra.retriever.index import BM25Index
    from infra.retriever.server import make_server
    from tests.episode_fixtures import save_search_model
    from worker_contract.planes import get_plane
    from worker_contract.tasks.psqa_retrieval import RetrieverClient, search_tool

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    d = save_search_model(tmp / arch, arch)
    BM25Index.build(synthetic_corpus(500, seed=1), source="generated").save(tmp / "idx")
    srv = make_server(BM25Index.load(tmp / "idx"), "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    hf = AutoModelForCausalLM.from_pretrained(d)
    state = get_plane("bf16").from_hf({k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"})
    return d, state, search_tool(RetrieverClient(srv.url), k=3, strict=True), srv


def run(arch: str, groups: int, n: int, budget: int) -> dict:
    import numpy as np

    from worker_contract.tasks import get_task
    from worker_contract.tasks.psqa import PsqaProblem
    from worker_contract.worker.mlx_model import MlxPolicy
    from worker_contract.worker.model import PolicyModel

    d, state, search, srv = search_setup("psqa-bench-", arch)
    tp = PolicyModel(d, threads=1, seed=1, device="cpu")
    tp.load_plane("bf16", state)
    mp = MlxPolicy(d, plane="bf16", seed=1, dtype="float32")
    mp.load_plane("bf16", state)
    task = get_task("psqa")
    problem = PsqaProblem(id="b", question="Which protein does the dmd gene encode?", answer="dystrophin",
                          golden_answers=("dystrophin",))
    prompt = tp.prompt_ids(task.messages(problem))
    out = {}
    for name, pol in (("torch", tp), ("mlx", mp)):
        rows, worst, t0 = [], {"torch": 0.0, "mlx": 0.0}, time.monotonic()
        for _ in range(groups):
            eps, count = pol.sample_episodes(prompt, n, temperature=1.0, top_p=1.0, max_new_tokens=budget,
                                             search=search)
            rows.append({"extend": count.extend, "reprefill": count.reprefill, "turns": count.turns,
                         "searches": sum(len(e.searches) for e in eps),
                         "tool_tokens": sum(len(e.loss_mask) - sum(e.loss_mask) for e in eps),
                         "sampled_tokens": sum(sum(e.loss_mask) for e in eps)})
            for e in eps:
                m = np.array(e.loss_mask, dtype=bool)
                t, x = _fresh(tp, mp, prompt, e.response_ids)
                lp = np.array(e.behavior_logprobs)
                worst["torch"] = max(worst["torch"], float(np.abs(t - lp)[m].max()))
                worst["mlx"] = max(worst["mlx"], float(np.abs(x - lp)[m].max()))
        ext, re_ = sum(r["extend"] for r in rows), sum(r["reprefill"] for r in rows)
        out[name] = {"groups": rows, "prefill_extend": ext, "prefill_reprefill": re_,
                     "prefill_ratio": round(re_ / max(ext, 1), 2), "per_episode_extend": round(ext / (groups * n), 1),
                     "per_episode_reprefill": round(re_ / (groups * n), 1),
                     "max_abs_logprob_diff_vs_torch_recompute": worst["torch"],
                     "max_abs_logprob_diff_vs_mlx_recompute": worst["mlx"], "seconds": round(time.monotonic() - t0, 1)}
        print(f"{arch} {name}: prefill {ext} extended vs {re_} re-prefilled ({out[name]['prefill_ratio']}x), "
              f"{sum(r['searches'] for r in rows)} searches, max |lp diff| torch {worst['torch']:.2e} "
              f"mlx {worst['mlx']:.2e}", flush=True)
    srv.shutdown()
    srv.server_close()
    return {"prompt_tokens": len(prompt), **out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.psqa_episodes", description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=number(int, at_least=1), default=4)
    p.add_argument("--n", type=number(int, at_least=1), default=8)
    p.add_argument("--budget", type=number(int, at_least=1), default=512)
    a = p.parse_args(argv)
    from bench.common import write_result

    result = {"settings": {"groups": a.groups, "n": a.n, "max_new_tokens": a.budget, "top_k_docs": 3,
                           "temperature": 1.0},
              "archs": {arch: run(arch, a.groups, a.n, a.budget) for arch in ("lfm2_moe", "lfm2")}}
    print(write_result("psqa_episodes", result, argv=argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
