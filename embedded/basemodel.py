"""The embedded default's base model, built on the spot because no pretrained weights can be downloaded.

`ensure_base` trains a byte-level BPE tokenizer (digits split one per token, like Qwen2's) on generated
GSM8K-format problems, builds a small Qwen2-architecture model from a config, and fine-tunes it with
supervision on worked solutions just long enough to be partly right, so RL has both signal (some samples
of a group are right) and room (most are not). The result is an ordinary HF directory (config.json,
model.safetensors, tokenizer files with a ChatML template) cached under `.stoa/cache/base-<digest>/`,
keyed by everything that shapes it, so a second run starts in seconds. The recipe's own base ships in
`embedded/base_gsm8k/` (weights pinned by digest): a clone copies it instead of building (docs/embedded.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import platform
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from trainer.progress import progress
from worker_contract.tasks import Problem, Task

from .config import EmbeddedBaseConfig

if TYPE_CHECKING:
    import torch
# torch is imported where it is used: the launcher's dry run and a run that installs the shipped base read
# this module's config digest and report without it (importing torch costs about 3 s of CPU)

#: ChatML, the format Qwen2 instruct models use; the tiny base speaks it too so MODEL= swaps cleanly.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: bump when the recipe below changes in a way the config digest cannot see
#: (2: built on one CPU thread, so every machine builds the same base)
BUILD_VERSION = 2
#: the recipe's base (runs/gsm8k.yaml `embedded.base`, task arithmetic) as built on this project's machine,
#: shipped with the repository; used in place of a build when its config digest is the one asked for and
#: its weights are these (tests/test_basemodel.py rebuilds it from scratch and compares)
SHIPPED_BASE = Path(__file__).resolve().parent / "base_gsm8k"
SHIPPED_WEIGHTS_SHA256 = "7339a6edbf2bdd5009ddd539567580107299705d1e1714cbccc066c41103de5e"


class BaseReport(BaseModel):
    """What building the base measured (written beside the weights as base.json)."""

    model_config = ConfigDict(extra="forbid")

    path: str
    params: int
    vocab_size: int
    sft_steps: int
    sft_seconds: float
    heldout_accuracy: float
    heldout_problems: int
    config_digest: str
    built_on: dict[str, str] | None = None
    """torch version, torch's CPU vector capability and the machine's architecture at build time: the same
    config builds other weights under another capability (AVX2 against AVX512) or another BLAS."""
    sft_threads: int | None = None
    """torch's CPU threads while it was supervised: 1 wherever it was built (a float sum's order follows the
    thread count; see _one_thread)."""
    shipped: bool = False
    """True when this copy came from the repository (SHIPPED_BASE) instead of a build here."""


def build_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on `texts`, wrapped for transformers with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def tiny_causal_lm(config_cls, model_cls, tokenizer, *, seed: int, **fields):
    """A randomly initialised `model_cls` (seeded) sized by `fields`, with what every embedded base shares: the
    tokenizer's vocabulary and special ids, tied embeddings, plain RoPE of base 10000."""
    import torch

    config = config_cls(vocab_size=len(tokenizer), tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                        architectures=[model_cls.__name__], **fields)
    torch.manual_seed(seed)
    return model_cls(config)


def build_model(tokenizer, cfg: EmbeddedBaseConfig):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return tiny_causal_lm(Qwen2Config, Qwen2ForCausalLM, tokenizer, seed=cfg.seed, hidden_size=cfg.hidden_size,
                          intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                          num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                          max_position_embeddings=512)


def prompt_ids(tokenizer, task: Task, problem: Problem) -> list[int]:
    """The prompt's token ids: the task's chat messages through the one renderer (worker_contract.tasks.base)."""
    from worker_contract.tasks.base import render_prompt

    return render_prompt(tokenizer, task.messages(problem))


def _sft_batch(tokenizer, task: Task, problems: list[Problem], directs: list[bool]) -> tuple[torch.Tensor, ...]:
    """Right-padded (ids, labels, attention mask); labels are -100 on the prompt and padding. Where
    `directs` is true the target is the bare final answer instead of the worked solution."""
    import torch

    rows = []
    for p, direct in zip(problems, directs, strict=True):
        pid = prompt_ids(tokenizer, task, p)
        target = f"#### {p.answer}" if direct else p.solution
        rid = tokenizer.encode(target + tokenizer.eos_token, add_special_tokens=False)
        rows.append((pid + rid, [-100] * len(pid) + rid))
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)], labels[i, : len(y)], attn[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    return ids, labels, attn


class SFTSteps:
    """Supervised fine-tuning on worked solutions of the task's training problems, one step at a time:
    AdamW with warmup then cosine decay over `cfg.sft_steps`, and a seeded draw of which targets are the
    bare final answer (`cfg.sft_direct_fraction`). The caller sets the model's training mode."""

    def __init__(self, model, tokenizer, task: Task, cfg: EmbeddedBaseConfig):
        import torch

        self.model, self.tokenizer, self.task, self.cfg = model, tokenizer, task, cfg
        self.train = task.dataset("train")
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0, betas=(0.9, 0.98))
        warm, total = max(1, cfg.sft_steps // 20), cfg.sft_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))
        )
        self.rng = random.Random(cfg.seed)

    def step(self, index: int) -> torch.Tensor:
        """One optimizer step on batch `index` of the training split (batches cycle over it); the loss,
        detached (reading it is the caller's choice, since on a GPU that waits for the step)."""

        cfg, train = self.cfg, self.train
        batch = [train[(index * cfg.sft_batch_size + j) % len(train)] for j in range(cfg.sft_batch_size)]
        directs = [self.rng.random() < cfg.sft_direct_fraction for _ in batch]
        return self.update(*_sft_batch(self.tokenizer, self.task, batch, directs))

    def update(self, ids, labels, attn) -> torch.Tensor:
        """One optimizer step on a batch of (ids, labels, attention mask): the loss, detached."""
        import torch

        ids, labels, attn = (t.to(self.model.device) for t in (ids, labels, attn))
        loss = self.model(input_ids=ids, attention_mask=attn, labels=labels).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        return loss.detach()


def supervise(model, tokenizer, task: Task, cfg: EmbeddedBaseConfig,
              on_step: Callable[[int, float], None] | None = None) -> None:
    """Fine-tune on worked solutions of training problems for `cfg.sft_steps` steps (`SFTSteps`)."""
    sft = SFTSteps(model, tokenizer, task, cfg)
    model.train()
    for step in range(cfg.sft_steps):
        loss = sft.step(step)
        if on_step is not None:
            on_step(step + 1, loss.item())
    model.eval()


def evaluate(model, tokenizer, task: Task, problems: Sequence[Problem], *, max_new_tokens: int,
             temperature: float = 1.0, greedy: bool = True, batch_size: int = 100, seed: int = 0) -> float:
    """Accuracy on `problems` under the task's own reward (the same code that scores rollouts)."""
    import torch

    from worker_contract.worker.sampling import sample

    if not problems:
        return 0.0
    gen = torch.Generator().manual_seed(seed)
    eos = [tokenizer.eos_token_id]
    correct = 0.0
    was_training = model.training
    model.eval()
    for start in range(0, len(problems), batch_size):
        chunk = list(problems[start:start + batch_size])
        outs = sample(model, [prompt_ids(tokenizer, task, p) for p in chunk], temperature=temperature,
                      max_new_tokens=max_new_tokens, eos_ids=eos, pad_id=tokenizer.pad_token_id,
                      greedy=greedy, generator=gen)
        for p, o in zip(chunk, outs, strict=True):
            correct += task.reward(tokenizer.decode(o.token_ids, skip_special_tokens=True), p)
    model.train(was_training)
    return correct / len(problems)


def config_digest(cfg: EmbeddedBaseConfig, task: Task) -> str:
    splits = {k: v.model_dump(mode="json") for k, v in getattr(task, "splits", {}).items()}  # generated data
    blob = json.dumps({"cfg": cfg.model_dump(mode="json"), "task": task.name, "splits": splits,
                       "build": BUILD_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def weights_digest(path: str | Path) -> str:
    """sha256 of a base directory's model.safetensors."""
    h = hashlib.sha256()
    with open(Path(path) / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_environment() -> dict[str, str]:
    """What, besides the config, decides a build's last bits (BaseReport.built_on): torch, its CPU vector
    capability, the architecture and the CPU's vendor (an AMD EPYC reporting AVX512 built other bits than the
    Intel Xeon the shipped base was built on)."""
    import torch

    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(), "cpu_vendor": cpu_vendor()}


def cpu_vendor() -> str:
    """The CPU's vendor id (GenuineIntel, AuthenticAMD) from /proc/cpuinfo, else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _install(src: Path, out: Path, report: BaseReport) -> BaseReport:
    """Copy a finished base directory to `out` atomically (another process's finished copy wins)."""
    tmp = out.with_name(out.name + f".tmp-{time.time_ns()}")
    shutil.copytree(src, tmp)
    (tmp / "base.json").write_text(report.model_copy(update={"path": str(out)}).model_dump_json(indent=2))
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return _cached(out)


def _shipped(digest: str) -> BaseReport | None:
    """The shipped base's report when it is the base for `digest` and its weights are the pinned ones."""
    try:
        report = BaseReport.model_validate_json((SHIPPED_BASE / "base.json").read_text())
        if report.config_digest != digest or weights_digest(SHIPPED_BASE) != SHIPPED_WEIGHTS_SHA256:
            return None
    except (OSError, ValueError):
        return None
    return report.model_copy(update={"shipped": True})


def ensure_base(cfg: EmbeddedBaseConfig, task: Task, cache_dir: Path, *, max_new_tokens: int,
                eval_problems: int = 200, log: Callable[[str], None] = print,
                on_sft_step: Callable[[int, float], None] | None = None, device: str | None = None,
                use_shipped: bool = True, show_progress: bool = False) -> BaseReport:
    """The cached base for `cfg`: the shipped one when it is that base (`use_shipped`), else built first
    (atomic: a half-built base is never used).

    `device`: where to supervise it (default the CPU; "cuda" for the larger bases benchmarks build);
    `show_progress`: a bar with the time left while building (lines every 30 s off a terminal)."""
    digest = config_digest(cfg, task)
    out = Path(cache_dir) / f"base-{digest}"
    if (out / "base.json").exists():
        return _cached(out)
    shipped = _shipped(digest) if use_shipped else None
    if shipped is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        return _install(SHIPPED_BASE, out, shipped)
    with build_lock(out, log):  # a second launch of the same base waits for the first, then uses its base
        if (out / "base.json").exists():
            return _cached(out)
        return _build(cfg, task, out, digest, max_new_tokens=max_new_tokens, eval_problems=eval_problems, log=log,
                      on_sft_step=on_sft_step, device=device, show_progress=show_progress)


def _build(cfg: EmbeddedBaseConfig, task: Task, out: Path, digest: str, *, max_new_tokens: int, eval_problems: int,
           log: Callable[[str], None], on_sft_step, device: str | None, show_progress: bool) -> BaseReport:
    """Build, score and cache the base (ensure_base holds the build lock)."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" bars would tear the launcher's display
    with _one_thread():
        threads = torch.get_num_threads()
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        t0 = time.time()
        train = task.dataset("train")
        corpus = [_render(task, train[i]) for i in range(cfg.tokenizer_corpus)]
        tokenizer = build_tokenizer(corpus, cfg.vocab_size)
        model = build_model(tokenizer, cfg).to(device or "cpu")
        params = sum(p.numel() for p in model.parameters())
        log(f"building the base model: Qwen2 {cfg.num_layers}x{cfg.hidden_size}, {params / 1e6:.2f} M parameters, "
            f"vocab {len(tokenizer)}; {cfg.sft_steps} supervised steps")
        with progress(f"building the base model ({cfg.sft_steps} supervised steps)", total=cfg.sft_steps,
                      show=show_progress, lines_every_s=30) as advance:
            def on_step(step: int, loss: float) -> None:
                advance(1)
                if on_sft_step is not None:
                    on_sft_step(step, loss)

            supervise(model, tokenizer, task, cfg, on_step)
        log(f"scoring the base on {eval_problems} held-out problems")
        acc = evaluate(model, tokenizer, task, task.dataset("test")[:eval_problems], max_new_tokens=max_new_tokens)
        tmp = out.with_name(out.name + f".tmp-{time.time_ns()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        report = BaseReport(path=str(out), params=params, vocab_size=len(tokenizer), sft_steps=cfg.sft_steps,
                            sft_seconds=round(time.time() - t0, 1), heldout_accuracy=acc,
                            heldout_problems=eval_problems, config_digest=digest, built_on=build_environment(),
                            sft_threads=threads)
        (tmp / "base.json").write_text(report.model_dump_json(indent=2))
        try:
            tmp.rename(out)
        except OSError:  # another process finished the same base first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        return _cached(out)


def _cached(out: Path) -> BaseReport:
    """The report of the base cached at `out`, naming `out` itself: a checkout copied with its .stoa/ keeps
    reports that name the original's directory, which the copy must not read from."""
    report = BaseReport.model_validate_json((out / "base.json").read_text())
    return report if Path(report.path) == out else report.model_copy(update={"path": str(out)})


@contextlib.contextmanager
def build_lock(out: Path, log: Callable[[str], None] = print):
    """An exclusive lock on building the cached directory `out` (`<out>.lock`, released when the block ends or
    the process dies): two launches that need the same base build it once."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            log(f"another launch is building {out.name}; waiting for it, then using its result")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def _one_thread():
    """torch on one CPU thread inside the block, the caller's count restored after. A float sum's order
    follows the thread count, and 1200 supervised steps grow that last-bit difference into another base
    (32-35% held-out and a different RL gain for the same config); on one thread every machine builds the
    same weights, at about 1.25x the time of two (docs/embedded.md)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _render(task: Task, problem: Problem) -> str:
    """Text the tokenizer is trained on: what the model will read and write."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in task.messages(problem))
    return f"{turns}<|im_start|>assistant\n{problem.solution or ''}<|im_end|>"
