"""The local runs' settings: the recipe's `embedded:` section, typed and validated here, not in the learner's
schema (trainer/config.py keeps it as the recipe gives it and reads none of it).

    EmbeddedRecipe      a RecipeConfig whose `embedded` section is EmbeddedConfig (what the local runs read)
    resolve_embedded    trainer.config.resolve with this schema; for a run on this machine (`local=True`) it
                        applies the section's `overrides` (or `model_overrides` with MODEL=) right after the YAML
The YAML keys are the recipe's as before; an error names the key (`embedded.workers`) and its value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from trainer.config import RecipeConfig, resolve


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class EmbeddedBaseConfig(_Model):
    """The small Qwen2-architecture base the embedded default builds when no model is given."""

    hidden_size: int = 128
    """Width of the tiny model."""
    num_layers: int = 4
    """Decoder layers."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (GQA groups)."""
    intermediate_size: int = 384
    """SwiGLU width."""
    vocab_size: int = 512
    """Byte-level BPE vocabulary trained on generated problems (digits are one token each)."""
    tokenizer_corpus: int = 4000
    """Generated problems the tokenizer is trained on."""
    sft_steps: int = 600
    """Supervised steps on generated problems before RL starts."""
    sft_batch_size: int = 32
    """Problems per supervised step."""
    sft_lr: float = 3e-3
    """Peak supervised learning rate (warmup then cosine decay)."""
    sft_direct_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Share of supervised examples that show only the final `#### N` instead of the worked solution
    (instruction data mixes both): the base then often answers without working, which RL unlearns."""
    sft_target_accuracy: tuple[float, float] = (0.2, 0.5)
    """Held-out accuracy band the base should land in (partly right, so RL has room)."""
    seed: int = 0
    """Seed of the supervised data and init."""


class EmbeddedPsqaConfig(_Model):
    """The embedded psqa run's pieces (embedded/psqa.py): generated corpus, retriever, base, evaluation."""

    entities: int = Field(3000, ge=10)
    """Abstracts of the generated corpus (embedded/psqa_synth.py), three facts and three questions each."""
    heldout_entities: int = Field(200, ge=1)
    """Entities whose questions are held out for evaluation (never trained on)."""
    seed: int = 0
    """Seed of the generated corpus."""
    retriever_tier: Literal["light", "medium", "heavy"] = "medium"
    """The local workers' --retriever-tier (all use the run's retriever on 127.0.0.1)."""
    max_turns: int = Field(2, ge=1)
    """Tool calls one episode may make (workers' --max-turns and the held-out evaluation)."""
    top_k: int = Field(3, ge=1)
    """Documents per search in the held-out evaluation (the workers' search tool returns 3)."""
    eval_k: int = Field(1, ge=1)
    """Samples per held-out question (pass@1 is their mean cover-EM)."""
    base: dict[str, Any] = {}
    """embedded/psqa_base.py's PsqaBaseConfig fields that differ from its defaults (the base built here)."""


class EmbeddedConfig(_Model):
    """How the embedded default (no GPU host, no R2 credentials) runs the loop on one machine."""

    workers: int = 2
    """Local reference workers started as separate processes."""
    worker_backend: Literal["torch", "mlx"] = "torch"
    """The local workers' backend (WORKER=): torch (the reference worker) or mlx (the MLX worker, as on a Mac;
    mlx[cpu] here)."""
    worker_backends: list[Literal["torch", "mlx"]] = []
    """One backend per local worker (e.g. [torch, mlx]); when set it replaces `workers` x `worker_backend`
    (WORKER= clears it)."""
    psqa: EmbeddedPsqaConfig = EmbeddedPsqaConfig()
    """The psqa recipe's embedded pieces (unused by other tasks)."""
    max_steps: int = 40
    """Learner steps before the run stops on its own."""
    time_budget_s: float = 600.0
    """Wall-clock budget for the RL phase."""
    eval_every: int = 5
    """Held-out evaluation every this many steps."""
    eval_problems: int = 200
    """Held-out problems per evaluation (own seed and number ranges, never trained on)."""
    eval_temperature: float | None = None
    """Sampling temperature of the held-out evaluation; None = greedy decoding."""
    base: EmbeddedBaseConfig = EmbeddedBaseConfig()
    overrides: dict[str, Any] = {}
    """Recipe values the embedded run replaces (dotted keys, e.g. `algo.lr: 2.0e-4`): the tiny CPU model
    needs its own learning rate, response budget and so on. Applied by `resolve(..., embedded=True)`."""
    model_overrides: dict[str, Any] = {}
    """The same for an embedded run on a real model from disk (MODEL=/path), instead of `overrides`."""


class EmbeddedRecipe(RecipeConfig):
    """A recipe with its `embedded:` section validated: what the launcher resolves and the local runs read."""

    embedded: EmbeddedConfig = EmbeddedConfig()  # type: ignore[assignment]  # the section, typed


def resolve_embedded(recipe: str, env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None,
                     *, local: bool = True, override_names: Mapping[str, str] | None = None) -> EmbeddedRecipe:
    """`trainer.config.resolve` with the `embedded:` section typed. `local=True` (the loop on this machine)
    applies the recipe's `embedded.overrides` (the small base built on the spot) or, when `overrides` names a
    `model.path` (MODEL=), its `embedded.model_overrides`, right after the YAML, so the environment and
    command line still win over them."""
    which = "model_overrides" if (overrides or {}).get("model.path") else "overrides"

    def section(tree: dict[str, Any]) -> Mapping[str, Any]:
        return dict((tree.get("embedded") or {}).get(which) or {}) if local else {}

    return cast(EmbeddedRecipe, resolve(recipe, env, overrides, override_names=override_names, after_yaml=section,
                                        schema=EmbeddedRecipe))
