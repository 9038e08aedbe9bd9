"""Held-out PaperSearchQA evaluation: cover-EM pass@1, pass@k and search rate per policy version.

Runs apart from the learner (its own GPU, `--device cuda:1`, or its own box) so the primary signal, the
held-out curve, never slows training. It follows a run's published versions in the bucket as a worker reads
them (`--run ID --base DIR`; the base gives architecture and tokenizer), evaluates one HF checkpoint
(`--model DIR`), or each new HF checkpoint under `--watch DIR` (`v<N>`/`step_<N>`/`iter_<N>`). Points go
to `<out>/psqa_eval.jsonl`, the curve to `<out>/psqa_eval.png`; the embedded psqa run draws its curve with
the same functions. More in docs/embedded.md (module notes).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from worker_contract.cli import number

CURVE_FILE, PLOT_FILE = "psqa_eval.jsonl", "psqa_eval.png"
_VERSION_DIR = re.compile(r"^(?:v|step_|iter_)0*(\d+)$")


class EvalPoint(BaseModel):
    """One point of the held-out curve."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    version: int
    """Policy version (or training step) the checkpoint holds."""
    questions: int
    """Held-out questions evaluated."""
    k: int
    """Samples per question."""
    pass1: float
    """Mean cover-EM over all samples (the unbiased pass@1)."""
    pass_k: float
    """Mean unbiased pass@k over questions."""
    search_rate: float
    """Fraction of episodes that called the search tool at least once."""
    searches_per_episode: float
    """Mean tool calls per episode."""
    correct_after_search: float = 0.0
    """Share of the correct episodes that searched before answering (answers found through the tool)."""
    response_tokens: float
    """Mean response length in tokens (sampled plus tool tokens)."""
    seconds: float
    """Wall time of this evaluation."""
    model: str = ""
    """Where the checkpoint came from."""


def heldout_subset(problems: Sequence, n: int, seed: int = 0) -> list:
    """The same `n` test questions for every version: a seeded shuffle of the test split, cut at n."""
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    return [problems[i] for i in order[: min(n, len(order))]]


def evaluate(problems: Sequence, task, encode_prompt: Callable, generate_batch, encode, search, *, k: int,
             max_new_tokens: int, max_turns: int, version: int, model: str = "",
             questions_per_batch: int = 16) -> EvalPoint:
    """Run k episodes per question and reduce them to one curve point. The episodes of
    `questions_per_batch` questions run in lockstep (one batched generate call per turn for all of them):
    the same episodes as one question at a time, in a fraction of the forward passes."""
    from worker_contract.tasks.psqa import pass_at_k, run_episodes

    t0 = time.monotonic()
    answered = []  # (question, its k episodes)
    for i in range(0, len(problems), questions_per_batch):
        chunk = list(problems[i:i + questions_per_batch])
        prompts = [encode_prompt(task.messages(problem)) for problem in chunk for _ in range(k)]
        eps = run_episodes(prompts, generate_batch, encode, search, max_new_tokens, max_turns)
        answered += [(problem, eps[j * k:(j + 1) * k]) for j, problem in enumerate(chunk)]
    p1 = pk = searched = calls = tokens = 0.0
    correct_total = correct_searched = 0
    for problem, eps in answered:
        right = [task.reward(ep.text, problem) >= 1.0 for ep in eps]
        correct = sum(right)
        correct_total += correct
        correct_searched += sum(r and bool(ep.searches) for r, ep in zip(right, eps, strict=True))
        p1 += correct / k
        pk += pass_at_k(k, correct, k)
        searched += sum(bool(ep.searches) for ep in eps) / k
        calls += sum(len(ep.searches) for ep in eps) / k
        tokens += sum(len(ep.response_ids) for ep in eps) / k
    n = max(len(problems), 1)
    return EvalPoint(version=version, questions=len(problems), k=k, pass1=p1 / n, pass_k=pk / n,
                     search_rate=searched / n, searches_per_episode=calls / n,
                     correct_after_search=correct_searched / correct_total if correct_total else 0.0,
                     response_tokens=tokens / n,
                     seconds=time.monotonic() - t0, model=model)


def append_point(out_dir: str | Path, point: EvalPoint) -> Path:
    path = Path(out_dir) / CURVE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    from .metrics import end_torn_line

    end_torn_line(path)
    with open(path, "a") as f:
        f.write(point.model_dump_json() + "\n")
    return path


def read_curve(out_dir: str | Path) -> list[EvalPoint]:
    """Points in version order; a torn last line (a crash mid-write) is skipped."""
    path = Path(out_dir) / CURVE_FILE
    points = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                points.append(EvalPoint.model_validate_json(line))
            except ValueError:
                continue
    return sorted(points, key=lambda p: p.version)


def plot_curve(out_dir: str | Path) -> Path | None:
    """Redraw the held-out curve PNG (Agg backend); None when there is nothing to draw yet."""
    points = read_curve(out_dir)
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = [p.version for p in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(v, [p.pass1 for p in points], "o-", label="cover-EM pass@1")
    if points[-1].k > 1:  # at k=1 pass@k is pass@1, a second line hidden under the first
        ax.plot(v, [p.pass_k for p in points], "s-", label=f"pass@{points[-1].k}")
    ax.plot(v, [p.search_rate for p in points], "^--", label="search rate")
    ax.set_xlabel("policy version")
    ax.set_ylim(0, 1)
    ax.set_title(f"PaperSearchQA held-out ({points[-1].questions} questions)")
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(out_dir) / PLOT_FILE
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def cut_at_stop(decode: Callable[[list[int]], str], ids: list[int], start: int, stops: Sequence[str]) -> int | None:
    """Length of the shortest prefix of `ids` (at least `start`+1 long) whose text contains a stop string."""
    for j in range(start, len(ids)):
        if any(s in decode(ids[: j + 1]) for s in stops):
            return j + 1
    return None


def hf_generate_batch(model, tokenizer, *, temperature: float, top_p: float = 1.0, chunk: int = 64,
                      generator=None):
    """A GenerateBatch over an HF model: the reference sampler in chunks of `chunk` tokens, each row cut
    at its first stop string (a few tokens past it are sampled and discarded; their log-probs never leave)."""
    from worker_contract.tasks.psqa import STOP_STRINGS, TurnOutput
    from worker_contract.worker.sampling import sample

    eos = [t for t in ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731

    def generate_batch(contexts: list[list[int]], budgets: list[int]) -> list:
        rows = [{"ids": [], "lps": [], "eos": False, "done": False} for _ in contexts]
        while not all(r["done"] for r in rows):
            live = [i for i, r in enumerate(rows) if not r["done"]]
            n = min(chunk, max(budgets[i] - len(rows[i]["ids"]) for i in live))
            outs = sample(model, [contexts[i] + rows[i]["ids"] for i in live], temperature=temperature,
                          top_p=top_p, max_new_tokens=n, eos_ids=eos, pad_id=pad, generator=generator)
            for i, c in zip(live, outs, strict=True):
                r, start = rows[i], len(rows[i]["ids"])
                room = budgets[i] - start
                r["ids"] += c.token_ids[:room]
                r["lps"] += c.logprobs[:room]
                cut = cut_at_stop(decode, r["ids"], start, STOP_STRINGS)
                if cut is not None:
                    r["ids"], r["lps"], r["done"] = r["ids"][:cut], r["lps"][:cut], True
                elif c.finish_reason == "stop" and len(c.token_ids) <= room:
                    r["eos"] = r["done"] = True
                elif len(r["ids"]) >= budgets[i]:
                    r["done"] = True
        return [TurnOutput(r["ids"], r["lps"], decode(r["ids"]), r["eos"]) for r in rows]

    return generate_batch


def version_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """HF checkpoints under `root` named v<N>/step_<N>/iter_<N> (with a config.json), in version order."""
    found = []
    for d in Path(root).iterdir() if Path(root).exists() else []:
        m = _VERSION_DIR.match(d.name)
        if m and (d / "config.json").exists():
            found.append((int(m.group(1)), d))
    return sorted(found)


class PublishedRun:
    """`--run`: the run's newest published version, as its workers see it: a verified join at the newest anchor,
    then each signed patch (worker_contract.reconstruct), loaded into the workers' own model of `--base`.
    The learner's checkpoints are not HF models (torch state on the native engine, torch_dist on slime): the
    bucket is where every engine's versions are."""

    def __init__(self, store, run: str, base_dir: str | Path, device: str):
        from worker_contract.manifest import load_manifest
        from worker_contract.reconstruct import Reconstructor
        from worker_contract.worker.identity import check_identity

        self.store, self.run, self.base_dir, self.device = store, run, Path(base_dir), device
        manifest = load_manifest(store, run)
        if manifest.task != "psqa":
            raise ValueError(f"run {run!r} trains task {manifest.task!r}: psqa_eval scores PaperSearchQA runs")
        check_identity(self.base_dir, manifest)  # the run's model, tokenizer and chat template, as a worker checks
        self.plane, self.max_new_tokens = manifest.plane, manifest.max_new_tokens
        self.rec = Reconstructor(store, run, plane=self.plane)
        self._policy, self._said = None, None

    @property
    def label(self) -> str:
        """What a point of this run names as its model (`EvalPoint.model`), before its version."""
        return f"{self.store.url} run {self.run}"

    def newest(self) -> int | None:
        """Catch up with the signed pointer; the version now held (None before the first publish). What the
        bucket refuses or cannot answer now (nothing published yet, a forged pointer, a squatted patch, a store
        outage) is said once and waited out, as a worker does: the version held stays."""
        from worker_contract.pointer import PointerError
        from worker_contract.reconstruct import SyncError
        from worker_contract.store import StoreError

        try:
            self.rec.follow()  # the first call joins
            self._said = None
        except (SyncError, PointerError, StoreError) as e:
            said = f"{type(e).__name__}: {e}"
            if said != self._said:
                print(f"psqa_eval: run {self.run}: {said}; trying again at the next poll", file=sys.stderr,
                      flush=True)
            self._said = said
        return self.rec.version

    def evaluate(self, problems: Sequence, task, search, args) -> EvalPoint:
        """Load the version held into the model (made on first use) and evaluate it."""
        from worker_contract.worker.model import PolicyModel

        if self._policy is None:
            self._policy = PolicyModel(self.base_dir, device=self.device, record_routes=False)
        version = self.rec.version
        self._policy.load_plane(self.plane, self.rec.state)
        return evaluate_policy(self._policy, version, problems, task, search, k=args.k,
                               max_new_tokens=args.max_new_tokens or self.max_new_tokens, max_turns=args.max_turns,
                               temperature=args.temperature, seed=args.seed, model=f"{self.label} v{version}")


def evaluate_policy(policy, version: int, problems: Sequence, task, search, *, k: int, max_new_tokens: int,
                    max_turns: int, temperature: float, seed: int, model: str = "") -> EvalPoint:
    """Evaluate a worker's model (worker_contract.worker.model.PolicyModel) holding published `version`, its
    sampling seeded by `seed` + version: --run's follower and the embedded psqa run's evaluator."""
    import torch

    gen = torch.Generator(device=policy.device).manual_seed(seed + version)
    with torch.no_grad():
        return evaluate(problems, task, policy.prompt_ids, hf_generate_batch(
            policy.model, policy.tokenizer, temperature=temperature, generator=gen), policy.encode, search, k=k,
            max_new_tokens=max_new_tokens, max_turns=max_turns, version=version, model=model)


def evaluate_checkpoint(path: str | Path, version: int, problems: Sequence, task, search, args) -> EvalPoint:
    """Load one HF checkpoint on `args.device` and evaluate it."""
    import torch
    import transformers

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    gen = torch.Generator(device=device).manual_seed(args.seed + version)
    generate_batch = hf_generate_batch(model, tok, temperature=args.temperature, generator=gen)

    def encode_prompt(messages):
        from worker_contract.tasks.base import render_prompt

        return render_prompt(tok, messages)

    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    point = evaluate(problems, task, encode_prompt, generate_batch, encode, search, k=args.k,
                     max_new_tokens=args.max_new_tokens, max_turns=args.max_turns, version=version,
                     model=str(path))
    del model
    return point


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="a run id: follow its published versions in the bucket (needs --base); the "
                     "learner's own checkpoints are not HF models on either engine")
    src.add_argument("--model", help="one HF checkpoint directory to evaluate")
    src.add_argument("--watch", help="directory where v<N>/step_<N>/iter_<N> HF checkpoints appear")
    p.add_argument("--base", help="with --run: the run's base HF directory (config and tokenizer; its weights "
                   "are not read)")
    p.add_argument("--store", help="with --run: the store URL (default: DRL_STORE, else R2 from the environment "
                   "or .r2env)")
    p.add_argument("--version", type=number(int, at_least=1), default=1, help="version label of --model")
    p.add_argument("--out", required=True, help="directory for psqa_eval.jsonl and psqa_eval.png")
    p.add_argument("--retriever", default=None, help="retriever URL (default: DRL_RETRIEVER_URL)")
    p.add_argument("--data-dir", default=None, help="DRL_PSQA_DIR with test.jsonl (default: download)")
    p.add_argument("--questions", type=number(int, at_least=1), default=500, help="held-out questions per point (default 500)")
    p.add_argument("--k", type=number(int, at_least=1), default=8, help="samples per question, the k of pass@k (default 8)")
    p.add_argument("--top-k", type=number(int, at_least=1), default=3, help="documents per search (default 3)")
    p.add_argument("--max-new-tokens", type=number(int, at_least=1), default=None,
                   help="an episode's token budget, sampled and tool tokens (default: --run's run.json, the "
                   "workers' budget; else the fleet recipe's algo.max_new_tokens)")
    p.add_argument("--max-turns", type=number(int, at_least=1), default=4, help="tool calls per episode (default 4)")
    p.add_argument("--temperature", type=number(float, above=0), default=1.0,
                   help="sampling temperature (default 1.0: pass@1 as the fleet curve measures it)")
    p.add_argument("--every", type=number(int, at_least=1), default=1,
                   help="--watch: evaluate versions divisible by this; --run: at least this many versions apart; "
                   "not used with --model (default 1)")
    p.add_argument("--poll-s", type=number(float, at_least=0), default=60.0, help="--watch/--run polling interval in seconds (default 60)")
    p.add_argument("--device", default="cuda:1", help="a GPU the learner does not use, or cpu (default cuda:1)")
    p.add_argument("--seed", type=number(int, at_least=0), default=0,
                   help="seed of the question subset and the sampling (default 0)")
    return p


def _check_args(args, client) -> PublishedRun | None:
    """What would otherwise fail late or quietly, refused before any model loads (ValueError, one sentence):
    a --watch, --model or --base that is not a directory, a --run the store does not hold, an --out that cannot
    be written, a --device this machine lacks, a retriever that does not answer. Returns --run's follower."""
    from worker_contract.cli import output_dir
    from worker_contract.tasks.psqa_retrieval import RetrieverError

    if (args.base is not None or args.store is not None) and args.run is None:
        raise ValueError("--base and --store go with --run (a run's published versions in the bucket)")
    if args.run is not None and args.base is None:
        raise ValueError("--run needs --base DIR: the run's base HF directory (config.json and tokenizer)")
    if args.base is not None and not (Path(args.base) / "config.json").is_file():
        raise ValueError(f"--base {args.base} has no config.json: name the run's base HF directory")
    for flag, path in (("--watch", args.watch), ("--model", args.model)):
        if path is not None and not Path(path).is_dir():
            raise ValueError(f"{flag} {path} is not a directory: name the {'checkpoints' if flag == '--watch' else 'HF'}"
                             " directory (for --watch, start the evaluation once the learner has made it)")
    output_dir(args.out)
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a device: cpu, cuda or cuda:N") from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= gpus:
        raise ValueError(f"--device {args.device}: this machine has {gpus} CUDA GPU(s); name one it has (on the "
                         "learner's box, one the learner does not use), or --device cpu")
    try:
        client.health()
    except RetrieverError as e:
        raise ValueError(f"--retriever {args.retriever} does not answer as a retriever ({e}): start it "
                         "(python -m infra.retriever serve) or fix the URL") from None
    return _published_run(args) if args.run is not None else None


def _retriever(args):
    """The retriever client of --retriever, else DRL_RETRIEVER_URL; a malformed URL is named as it was given."""
    import os

    from worker_contract.tasks.psqa_retrieval import RetrieverClient

    given = ("--retriever", args.retriever) if args.retriever else ("DRL_RETRIEVER_URL",
                                                                   os.environ.get("DRL_RETRIEVER_URL", "").strip())
    if not given[1]:
        raise ValueError("no retriever named: pass --retriever URL or set DRL_RETRIEVER_URL (the run's retriever, "
                         "python -m infra.retriever serve)")
    args.retriever = given[1]
    try:
        return RetrieverClient(given[1])
    except ValueError:
        raise ValueError(f"{given[0]} {given[1]!r} is not an http(s) URL with a host; e.g. http://10.0.0.5:8000"
                         ) from None


def _recipe_budget() -> int:
    """The fleet recipe's episode budget (algo.max_new_tokens), for checkpoints that carry no run.json."""
    from trainer.config import load_recipe_file, recipe_path

    return int(load_recipe_file(recipe_path("psqa"))["algo"]["max_new_tokens"])


def _published_run(args) -> PublishedRun:
    """--run's follower, on --store or the environment's store; a run the store lacks is refused."""
    import os

    from trainer.config import REPO_ROOT
    from worker_contract.env import load_env, r2_configured, redact, store_url
    from worker_contract.layout import check_run_id
    from worker_contract.store import NotFound, open_store

    check_run_id(args.run)
    env = load_env(os.environ, repo_root=REPO_ROOT)
    if not (args.store or env.get("DRL_STORE", "").strip() or r2_configured(env)):
        raise ValueError("--run: no store named: pass --store URL, or set DRL_STORE or the four R2 values "
                         "(.r2env, as on the trainer's box)")
    url = store_url(args.store, env, REPO_ROOT)
    try:
        return PublishedRun(open_store(url, env), args.run, args.base, args.device)
    except NotFound:
        raise ValueError(f"run {args.run!r} has no run.json in {redact(url)}: check --run and --store") from None


def main(argv: list[str] | None = None, prog: str = "python -m entrypoints.psqa_eval") -> int:
    """The evaluation process (entrypoints/psqa_eval.py): a run's newest published version at each poll (--run),
    one checkpoint (--model), or every new one under --watch."""
    args = _parser(prog).parse_args(argv)
    from worker_contract.tasks.psqa import PsqaTask
    from worker_contract.tasks.psqa_retrieval import RetrieverError, search_tool

    client = _retriever(args)
    follower = _check_args(args, client)
    if args.max_new_tokens is None and follower is None:  # --run's default is its run.json's (PublishedRun)
        args.max_new_tokens = _recipe_budget()
    curve = read_curve(args.out)
    others = [p.model for p in curve if follower is not None and not p.model.startswith(follower.label + " v")]
    if others:  # one file, one line in the plot: two runs' points would zigzag into one curve
        raise ValueError(f"--out {args.out} holds the curve of {others[0].rsplit(' v', 1)[0]}: give each run its "
                         "own --out")
    done = {p.version for p in curve}
    task = PsqaTask(args.data_dir)
    problems = heldout_subset(task.dataset("test"), args.questions, args.seed)
    search = search_tool(client, k=args.top_k, strict=True)  # a failed search fails the point, never scores 0
    while True:
        if follower is not None:  # the newest version, once it is --every past the last point
            newest = follower.newest()
            due = newest is not None and newest not in done and (not done or newest >= max(done) + args.every)
            found = [(newest, None)] if due else []
        else:
            found = ([(v, d) for v, d in version_dirs(args.watch) if v not in done and not v % args.every]
                     if args.watch else [(args.version, Path(args.model))])
            if args.model and args.version in done:
                print(f"{prog}: v{args.version} is already in {args.out}/psqa_eval.jsonl; evaluating it again "
                      "adds a second point", file=sys.stderr)
        for version, path in found:
            try:
                point = (follower.evaluate(problems, task, search, args) if path is None
                         else evaluate_checkpoint(path, version, problems, task, search, args))
            except RetrieverError as e:
                print(f"{prog}: the retriever failed while evaluating v{version} ({e}); no point written: its "
                      "score would measure the retriever, not the policy", file=sys.stderr)
                return 1
            append_point(args.out, point)
            plot_curve(args.out)
            done.add(version)
            print(json.dumps(point.model_dump()), flush=True)
        if args.model:
            return 0
        time.sleep(args.poll_s)
