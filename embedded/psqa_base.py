"""The embedded psqa run's base model: a small LFM2-MoE (the fleet model's architecture), built on the spot.

`ensure_psqa_base` trains a byte-level BPE tokenizer (the psqa tags as whole tokens, ChatML template) on
search traces of the generated corpus (embedded/psqa_synth.py), builds a few-layer `lfm2_moe` from a config
and supervises it into the search format: `<search> entity </search>`, the retriever's real documents as
a tool turn (loss mask 0, as the task says), then `<answer> X </answer>`; other traces answer at once with
a guess. It ends searching some of the time and mostly right when it does, so RL has signal and room.
The HF directory loads in transformers and mlx-lm; it is cached under `<cache>/psqa-base-<digest>/`,
keyed by everything that shapes it (config, data files, the search tool's answers to probe queries).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from trainer.progress import progress
from worker_contract.tasks.base import render_prompt
from worker_contract.tasks.psqa import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    INFO_CLOSE,
    INFO_OPEN,
    SEARCH_CLOSE,
    SEARCH_OPEN,
    PsqaProblem,
    PsqaTask,
    Search,
    tool_turn_text,
)

from . import psqa_synth
from .basemodel import (
    SFTSteps,
    _one_thread,
    build_environment,
    build_lock,
    build_tokenizer,
    prompt_ids,
    tiny_causal_lm,
    weights_digest,
)

#: bump when the recipe below changes in a way the digest cannot see
BUILD_VERSION = 1
TAGS = [SEARCH_OPEN, SEARCH_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, INFO_OPEN, INFO_CLOSE]
PROBE_QUERIES = 8
"""Train questions whose search results enter the digest (top-k and the documents' format shape traces)."""


class PsqaBaseConfig(BaseModel):
    """The small LFM2-MoE the embedded psqa run builds, and how it is supervised."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    hidden_size: int = 128
    """Width of the model."""
    layer_types: tuple[str, ...] = ("conv", "full_attention", "conv", "full_attention")
    """LFM2 block kinds, one per layer (short convolutions and attention, as the fleet model mixes them)."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads."""
    num_dense_layers: int = 1
    """Leading layers with a dense SwiGLU instead of experts."""
    intermediate_size: int = 320
    """Dense SwiGLU width."""
    num_experts: int = 4
    """Experts per MoE layer."""
    experts_per_token: int = 2
    """Experts each token is routed to."""
    moe_intermediate_size: int = 128
    """Each expert's SwiGLU width."""
    vocab_size: int = 1500
    """Byte-level BPE vocabulary (specials and the six psqa tags come on top)."""
    tokenizer_traces: int = 1500
    """Train traces the tokenizer is trained on."""
    sft_steps: int = 1000
    """Supervised steps."""
    short_steps: int = 750
    """Supervised steps first taken on traces whose prompt is the question alone (no instruction): a third
    of the tokens, so the copying the format needs (entity into the query, answer out of the documents)
    is learned at a third of the cost, then carried over to the full prompt."""
    sft_batch_size: int = 32
    """Traces per supervised step."""
    sft_lr: float = 3e-3
    """Peak supervised learning rate (warmup then cosine decay)."""
    search_fractions: dict[str, float] = {"protein": 0.7, "organism": 0.35, "disease": 0.1}
    """Share of the supervised traces that search, per question category (others: `search_fraction`); the
    rest answer at once with a guess (an answer of the same category, almost always wrong). Uneven
    shares make greedy decoding search on some questions and not on others."""
    search_fraction: float = Field(0.35, ge=0.0, le=1.0)
    """Share of searching traces for a category `search_fractions` does not name."""
    max_new_tokens: int = 160
    """Response budget (sampled and tool tokens) of the build's own evaluation."""
    eval_questions: int = 100
    """Held-out questions the build scores the base on (k=4 at temperature 1, and greedy)."""
    seed: int = 0
    """Seed of the init, the traces and the evaluation."""


class PsqaBaseReport(BaseModel):
    """What building the base measured (written beside the weights as base.json)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    path: str
    params: int
    vocab_size: int
    sft_steps: int
    build_seconds: float
    """Wall time of the whole build (tokenizer, supervision, evaluation)."""
    config_digest: str
    weights_sha256: str
    heldout_questions: int
    pass1: float
    """Held-out cover-EM pass@1 at temperature 1 (4 samples per question)."""
    search_rate: float
    """Share of those episodes that searched."""
    pass1_searched: float
    """cover-EM of the episodes that searched (what RL can spread to the others)."""
    pass1_direct: float
    """cover-EM of the episodes that answered without searching."""
    greedy_pass1: float
    greedy_search_rate: float
    built_on: dict[str, str] | None = None


# ---------------------------------------------------------------------------------------------- data

def load_problems(data_dir: str | Path) -> tuple[PsqaTask, list[PsqaProblem], list[PsqaProblem]]:
    """(task, train, test) of a psqa data directory; a ValueError naming what is missing otherwise."""
    d = Path(data_dir)
    for name in ("train.jsonl", "test.jsonl"):
        if not (d / name).is_file():
            raise ValueError(f"the psqa data directory {str(d)!r} has no {name}; write it with "
                             "embedded.psqa_synth.write_dataset(DIR)")
    task = PsqaTask(str(d))
    train, test = list(task.dataset("train")), list(task.dataset("test"))
    if not train or not test:
        raise ValueError(f"the psqa data directory {str(d)!r} has an empty {'train' if not train else 'test'} split")
    return task, train, test


_TEMPLATES = [re.compile("^" + re.escape(q).replace(re.escape("{e}"), r"(\S+)") + "$")
              for _, _, q in psqa_synth.RELATIONS]


def search_query(problem: PsqaProblem) -> str:
    """What a trace searches for: the question's entity (the whole question when no template fits)."""
    for pattern in _TEMPLATES:
        m = pattern.match(problem.question)
        if m:
            return m.group(1)
    return problem.question


class Trace(BaseModel):
    """One supervised trace: response ids after the prompt, and the task's loss mask over them."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    """1 on tokens the model writes, 0 on the tool turn (the retrieved documents)."""
    searched: bool


def make_trace(tokenizer, task: PsqaTask, problem: PsqaProblem, *, documents: str | None, guess: str,
               prompt: list[int] | None = None) -> Trace:
    """The trace an episode would record: with `documents`, search, read them (tool turn, tokenized on its
    own) and answer right; without, answer `guess` at once."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    pieces: list[tuple[list[int], int]] = []
    if documents is not None:
        pieces.append((enc(f"{SEARCH_OPEN} {search_query(problem)} {SEARCH_CLOSE}"), 1))
        pieces.append((enc(tool_turn_text(documents)), 0))
    answer = problem.answer if documents is not None else guess
    pieces.append((enc(f"{ANSWER_OPEN} {answer} {ANSWER_CLOSE}") + [tokenizer.eos_token_id], 1))
    ids = [t for p, _ in pieces for t in p]
    mask = [m for p, m in pieces for _ in p]
    return Trace(prompt_ids=prompt if prompt is not None else prompt_ids(tokenizer, task, problem),
                 response_ids=ids, loss_mask=mask, searched=documents is not None)


class TraceSource:
    """Seeded supervised traces over the train split: which ones search (per category), their documents
    (from `search`, memoized) and the guesses of the others."""

    def __init__(self, task: PsqaTask, train: Sequence[PsqaProblem], search: Search, cfg: PsqaBaseConfig):
        self.task, self.train, self.search, self.cfg = task, list(train), search, cfg
        self.rng = random.Random(cfg.seed)
        self.answers: dict[str | None, list[str]] = {}
        for p in self.train:
            self.answers.setdefault(p.category, []).append(p.answer)
        self._docs: dict[str, str] = {}
        self._prompts: dict[tuple[str, bool], list[int]] = {}
        self.tokenizer = None

    def documents(self, problem: PsqaProblem) -> str:
        q = search_query(problem)
        if q not in self._docs:
            self._docs[q] = self.search(q)
        return self._docs[q]

    def draw(self, problem: PsqaProblem) -> tuple[str | None, str]:
        share = self.cfg.search_fractions.get(problem.category or "", self.cfg.search_fraction)
        searched = self.rng.random() < share
        guess = self.rng.choice(self.answers[problem.category])
        return (self.documents(problem) if searched else None), guess

    def text(self, problem: PsqaProblem) -> str:
        """A rendered searching trace (what the tokenizer is trained on)."""
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in self.task.messages(problem))
        return (f"{turns}<|im_start|>assistant\n{SEARCH_OPEN} {search_query(problem)} {SEARCH_CLOSE}"
                f"{tool_turn_text(self.documents(problem))}{ANSWER_OPEN} {problem.answer} {ANSWER_CLOSE}<|im_end|>")

    def trace(self, problem: PsqaProblem, short: bool = False) -> Trace:
        documents, guess = self.draw(problem)
        key = (problem.id, short)
        if key not in self._prompts:
            if short:
                self._prompts[key] = render_prompt(self.tokenizer, [{"role": "user",
                                                                      "content": f"Question: {problem.question}"}])
            else:
                self._prompts[key] = prompt_ids(self.tokenizer, self.task, problem)
        return make_trace(self.tokenizer, self.task, problem, documents=documents, guess=guess,
                          prompt=self._prompts[key])


def batch_tensors(traces: Sequence[Trace], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, labels, attention mask); labels are -100 on the prompt, the tool turns, padding."""
    rows = [(t.prompt_ids + t.response_ids,
             [-100] * len(t.prompt_ids) + [i if m else -100 for i, m in zip(t.response_ids, t.loss_mask, strict=True)])
            for t in traces]
    width = max(len(x) for x, _ in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)], labels[i, : len(y)], attn[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    return ids, labels, attn


# --------------------------------------------------------------------------------------- tokenizer, model

def make_tokenizer(texts: Sequence[str], vocab_size: int):
    """basemodel's byte-level BPE + ChatML, with the psqa tags as whole (not special) tokens, so a decode
    that skips special tokens still shows them and a worker sees `</search>` the moment it is written."""
    tok = build_tokenizer(texts, vocab_size)
    tok.add_tokens(TAGS)
    return tok


def build_model(tokenizer, cfg: PsqaBaseConfig):
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    return tiny_causal_lm(
        Lfm2MoeConfig, Lfm2MoeForCausalLM, tokenizer, seed=cfg.seed, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=len(cfg.layer_types), layer_types=list(cfg.layer_types), num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, num_dense_layers=cfg.num_dense_layers, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.experts_per_token, max_position_embeddings=1024)


class _Steps(SFTSteps):
    """basemodel's optimizer and schedule, stepping on search traces instead of worked solutions."""

    def __init__(self, model, tokenizer, source: TraceSource, cfg: PsqaBaseConfig):
        super().__init__(model, tokenizer, source.task, cfg)  # type: ignore[arg-type]
        self.source = source
        self.order = random.Random(cfg.seed + 1)

    def step(self, index: int) -> torch.Tensor:
        short = index < self.cfg.short_steps
        batch = [self.source.trace(self.order.choice(self.source.train), short) for _ in range(self.cfg.sft_batch_size)]
        return self.update(*batch_tensors(batch, self.tokenizer.pad_token_id))


# ------------------------------------------------------------------------------------------ evaluation

def score(model, tokenizer, task: PsqaTask, problems: Sequence[PsqaProblem], search: Search, *, k: int,
          temperature: float, max_new_tokens: int, seed: int = 0, max_turns: int = 4,
          questions_per_batch: int = 16) -> dict[str, float]:
    """Held-out episodes through trainer.psqa_eval's sampler and the task's run_episodes and reward (as
    psqa_eval.evaluate runs them), split by whether the episode searched."""
    from trainer.psqa_eval import hf_generate_batch
    from worker_contract.tasks.psqa import run_episodes

    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    generate_batch = hf_generate_batch(model, tokenizer, temperature=temperature, generator=gen)
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    right = {True: 0.0, False: 0.0}
    count = {True: 0, False: 0}
    for i in range(0, len(problems), questions_per_batch):  # episodes of several questions in lockstep
        chunk = [p for p in problems[i:i + questions_per_batch] for _ in range(k)]
        for problem, ep in zip(chunk, run_episodes([prompt_ids(tokenizer, task, p) for p in chunk], generate_batch,
                                                   encode, search, max_new_tokens, max_turns), strict=True):
            s = bool(ep.searches)
            count[s] += 1
            right[s] += task.reward(ep.text, problem)
    n = max(1, count[True] + count[False])
    return {"pass1": (right[True] + right[False]) / n, "search_rate": count[True] / n,
            "pass1_searched": right[True] / max(1, count[True]), "pass1_direct": right[False] / max(1, count[False])}


# ------------------------------------------------------------------------------------------- the build

def base_digest(cfg: PsqaBaseConfig, data_dir: str | Path, search: Search, train: Sequence[PsqaProblem],
                device: str = "cpu") -> str:
    spec = {"cfg": cfg.model_dump(mode="json"), "build": BUILD_VERSION}
    if device != "cpu":  # another device's float sums give other weights (the CPU digest stays as it was)
        spec["device"] = device
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    for name in ("train.jsonl", "test.jsonl"):
        h.update((Path(data_dir) / name).read_bytes())
    for p in list(train)[:PROBE_QUERIES]:
        h.update(search(search_query(p)).encode())
    return h.hexdigest()[:16]


def _save_tokenizer(tokenizer, out: Path) -> None:
    tokenizer.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"  # the fast tokenizer as saved, not a class the model type implies
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))


def ensure_psqa_base(data_dir: str | Path, cache_dir: str | Path, search: Search, *,
                     cfg: PsqaBaseConfig | None = None, log: Callable[[str], None] = print,
                     show_progress: bool = False, device: str = "cpu") -> tuple[Path, PsqaBaseReport]:
    """(model directory, report) of the base for `cfg` over the data in `data_dir` (train.jsonl, test.jsonl as
    embedded.psqa_synth writes them), built first if it is not cached (atomic: a half-built base is never used).

    `search`: query -> the documents' text, exactly what workers' tool turns carry (the run's retriever).
    `show_progress`: a bar with the time left while building (lines every 30 s off a terminal).
    `device`: where to supervise and score it ("cuda" for the larger bases benchmarks build); saved in float32."""
    cfg = cfg or PsqaBaseConfig()
    task, train, test = load_problems(data_dir)
    digest = base_digest(cfg, data_dir, search, train, device)
    out = Path(cache_dir) / f"psqa-base-{digest}"
    if (out / "base.json").exists():
        return out, PsqaBaseReport.model_validate_json((out / "base.json").read_text())
    from transformers.utils import logging as hf_logging

    from .view import transformers_errors_only

    hf_logging.disable_progress_bar()
    # a second launch of the same base waits for the first, then uses its base
    with transformers_errors_only(), build_lock(out, log):
        if (out / "base.json").exists():
            return out, PsqaBaseReport.model_validate_json((out / "base.json").read_text())
        return _build(cfg, task, train, test, search, digest, out, log, show_progress, device)


def _build(cfg: PsqaBaseConfig, task: PsqaTask, train: list[PsqaProblem], test: list[PsqaProblem], search: Search,
           digest: str, out: Path, log: Callable[[str], None], show_progress: bool,
           device: str = "cpu") -> tuple[Path, PsqaBaseReport]:
    from trainer.psqa_eval import heldout_subset

    with _one_thread():
        t0 = time.time()
        source = TraceSource(task, train, search, cfg)
        texts = [source.text(p) for p in random.Random(cfg.seed).sample(train, min(cfg.tokenizer_traces, len(train)))]
        tokenizer = source.tokenizer = make_tokenizer(texts, cfg.vocab_size)
        model = build_model(tokenizer, cfg).to(device)
        params = sum(p.numel() for p in model.parameters())
        log(f"building the psqa base model: LFM2-MoE {len(cfg.layer_types)}x{cfg.hidden_size}, {cfg.num_experts} "
            f"experts, {params / 1e6:.2f} M parameters, vocab {len(tokenizer)}; {cfg.sft_steps} supervised steps")
        steps = _Steps(model, tokenizer, source, cfg)
        model.train()
        with progress(f"building the psqa base ({cfg.sft_steps} supervised steps)", total=cfg.sft_steps,
                      show=show_progress, lines_every_s=30) as advance:
            for i in range(cfg.sft_steps):
                steps.step(i)
                advance(1)
        model.eval()
        problems = heldout_subset(test, cfg.eval_questions, cfg.seed)
        log(f"scoring the psqa base on {len(problems)} held-out questions")
        with torch.no_grad():
            hot = score(model, tokenizer, task, problems, search, k=4, temperature=1.0,
                        max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
            greedy = score(model, tokenizer, task, problems, search, k=1, temperature=1e-4,
                           max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".tmp-{time.time_ns()}")
        model.to("cpu").save_pretrained(tmp)
        _save_tokenizer(tokenizer, tmp)
        report = PsqaBaseReport(
            path=str(out), params=params, vocab_size=len(tokenizer), sft_steps=cfg.sft_steps,
            build_seconds=round(time.time() - t0, 1), config_digest=digest, weights_sha256=weights_digest(tmp),
            heldout_questions=len(problems), **{k: round(v, 4) for k, v in hot.items()},
            greedy_pass1=round(greedy["pass1"], 4), greedy_search_rate=round(greedy["search_rate"], 4),
            built_on=build_environment())
        (tmp / "base.json").write_text(report.model_dump_json(indent=2))
        try:
            tmp.rename(out)
        except OSError:  # another process finished the same base first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        return out, PsqaBaseReport.model_validate_json((out / "base.json").read_text())
