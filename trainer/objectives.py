"""The objective registry: each policy-gradient term is one function over one typed input, `LossInputs`,
registered with `@register_objective(name, slime=False)` and returning a `PolicyTerm` (per-token loss, kept tokens).

`algo.objective` names one; the native learner runs it (`objective_loss` here, which adds the reducer,
the KL and the metrics every objective shares). `slime=True` says slime's hooks compute the same term; any other
is refused on the slime engine in one sentence (`check_engine`). No torch at import: the recipe's config
validates names against this registry where torch is absent. Signatures: docs/extending.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: the recipe's `algo` section (trainer.config.AlgoConfig; named loosely here, so that config, which validates
#: `algo.objective` against this registry, and this module do not import each other)
AlgoConfig = Any


@dataclass(frozen=True)
class LossInputs:
    """What an objective reads for one (micro-)batch; every tensor is `[B, R]` over response positions."""

    logprobs: torch.Tensor
    """The current policy's log-probs of the response tokens (carries the gradient)."""
    old_logprobs: torch.Tensor
    """The behaviour log-probs the worker recorded when it sampled (tool tokens: 0)."""
    ref_logprobs: torch.Tensor | None
    """The frozen reference model's log-probs; None when the step has no KL term."""
    advantages: torch.Tensor
    """Dr.GRPO advantages, per token (a per-sequence `[B]` is expanded by `make`)."""
    loss_mask: torch.Tensor
    """1 where a token is trained (sampled by the policy), 0 for tool tokens and padding."""

    @classmethod
    def make(cls, logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
             advantages: torch.Tensor, loss_mask: torch.Tensor) -> LossInputs:
        """The inputs with `advantages` per sequence (`[B]`) or per token brought to `[B, R]` in the
        log-probs' dtype."""
        adv = advantages if advantages.dim() == logprobs.dim() else advantages.unsqueeze(-1)
        return cls(logprobs, old_logprobs, ref_logprobs, adv.to(logprobs.dtype).expand_as(logprobs), loss_mask)


@dataclass(frozen=True)
class PolicyTerm:
    """An objective's answer: the per-token loss to minimise and the tokens that keep their gradient."""

    loss: torch.Tensor
    """`[B, R]` per-token policy loss (reduced by the Dr.GRPO reducer over `keep` and the loss mask)."""
    keep: torch.Tensor
    """`[B, R]` bool: False where the objective drops a token's gradient (the DPPO gate); all True otherwise."""


ObjectiveFn = Callable[[LossInputs, AlgoConfig], PolicyTerm]


@dataclass(frozen=True)
class Objective:
    """A registered objective."""

    name: str
    fn: ObjectiveFn
    slime: bool
    """slime's loss hooks compute this same term (only then may a recipe run it with train.engine: slime)."""


#: objective name -> its entry; `algo.objective` validates against it
OBJECTIVES: dict[str, Objective] = {}


def register_objective(name: str, *, slime: bool = False) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Register `fn(inputs: LossInputs, algo: AlgoConfig) -> PolicyTerm` under `name`; a name taken by another
    function is refused."""

    def add(fn: ObjectiveFn) -> ObjectiveFn:
        known = OBJECTIVES.get(name)
        if known is not None and known.fn is not fn:
            raise ValueError(f"objective name {name!r} is taken by {known.fn.__qualname__}; pick another name")
        OBJECTIVES[name] = Objective(name, fn, slime)
        return fn

    return add


def get_objective(name: str) -> Objective:
    """The objective registered under `name`; a ValueError naming the known ones otherwise."""
    if name not in OBJECTIVES:
        raise ValueError(f"algo.objective={name!r} is not known; known objectives: {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[name]


def check_engine(name: str, engine: str) -> None:
    """Refuse, in one sentence, an objective the engine cannot run (slime runs only `slime=True` ones)."""
    if engine == "slime" and not get_objective(name).slime:
        raise ValueError(f"algo.objective={name!r} runs on the native engine only (slime's loss hooks build the "
                         f"objectives {', '.join(sorted(n for n, o in OBJECTIVES.items() if o.slime))}): set "
                         "train.engine: native")


# -- the built-in objectives (docs/objective.md) -----------------------------------------------------------
@register_objective("recipe", slime=True)
def recipe(x: LossInputs, algo: AlgoConfig) -> PolicyTerm:
    """The recipe's term: the asymmetric DPPO gate, then dual-clip PPO on the ratio to the behaviour policy."""
    from .algo import dppo_keep_mask, dual_clip_loss, ratio_from_logp

    gate = algo.gate
    keep = dppo_keep_mask(x.logprobs, x.old_logprobs, x.advantages, gate.delta_low, gate.delta_high, gate.divergence)
    ratio = ratio_from_logp(x.logprobs, x.old_logprobs)
    return PolicyTerm(dual_clip_loss(ratio, x.advantages, algo.eps_clip, algo.eps_clip_high, algo.eps_clip_c), keep)


@register_objective("ppo")
def ppo(x: LossInputs, algo: AlgoConfig) -> PolicyTerm:
    """Plain PPO clipping on the ratio to the behaviour policy: no gate, no dual clip (a baseline)."""
    import torch

    from .algo import ppo_clip_loss, ratio_from_logp

    ratio = ratio_from_logp(x.logprobs, x.old_logprobs)
    return PolicyTerm(ppo_clip_loss(ratio, x.advantages, algo.eps_clip, algo.eps_clip_high),
                      torch.ones_like(x.loss_mask, dtype=torch.bool))


@register_objective("no_is")
def no_is(x: LossInputs, algo: AlgoConfig) -> PolicyTerm:
    """No importance correction: -A grad log pi, as if every group were on-policy (a baseline)."""
    import torch

    from .algo import no_is_loss

    return PolicyTerm(no_is_loss(x.logprobs, x.advantages), torch.ones_like(x.loss_mask, dtype=torch.bool))


# -- the native engine's loss: a registered term and what every objective shares ----------------------------
def _masked_stats(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    sel = x.detach()[mask]
    if sel.numel() == 0:
        return 0.0, 0.0, 0.0
    return float(sel.mean()), float(sel.max()), float(sel.min())


def policy_loss(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgoConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`objective_loss` on loose tensors: logp, behavior_logp, ref_logp and mask `[B, R]`, advantages `[B]` (per
    sequence) or `[B, R]`."""
    return objective_loss(LossInputs.make(logp, behavior_logp, ref_logp, advantages, mask), cfg)


def objective_loss(x: LossInputs, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one (micro-)batch and its metrics: the recipe's `algo.objective` from the registry
    for the policy term, then what every objective shares: the Dr.GRPO reducer over
    the tokens it keeps, `kl_coef` times the k3 KL to the reference, and the metrics (fractions are over mask
    tokens). Both terms are means over the rows, so a backend weights each micro-batch by its share of the rows.
    """
    import torch

    from .algo import drgrpo_reduce, k3_kl, ratio_from_logp, sequence_mean_reduce

    logp, mask, adv = x.logprobs, x.loss_mask, x.advantages
    valid = mask.bool()
    term = get_objective(cfg.objective).fn(x, cfg)
    keep = term.keep
    keep_f = keep.to(logp.dtype)
    pg_loss = drgrpo_reduce(term.loss * keep_f, mask, cfg.max_new_tokens)
    if x.ref_logprobs is not None and cfg.kl_coef != 0:
        kl = k3_kl(logp, x.ref_logprobs)
        kl_loss = sequence_mean_reduce(kl, keep_f * mask.to(logp.dtype), mask)
    else:
        kl = torch.zeros_like(logp)
        kl_loss = logp.new_zeros(())
    loss = pg_loss + cfg.kl_coef * kl_loss

    with torch.no_grad():
        n = max(int(valid.sum()), 1)
        r = ratio_from_logp(logp, x.old_logprobs).detach()
        clip_low = valid & (adv < 0) & (r < 1.0 - cfg.eps_clip)
        clip_high = valid & (adv > 0) & (r > 1.0 + cfg.eps_clip_high)
        clip_dual = valid & (adv < 0) & (r > cfg.eps_clip_c)
        r_mean, r_max, r_min = _masked_stats(r, valid)
        kl_mean, kl_max, _ = _masked_stats(kl, valid)
        metrics = {
            "loss": float(loss.detach()),
            "pg_loss": float(pg_loss.detach()),
            "kl_loss": float(kl_loss.detach()),
            "gate_drop_frac": float((valid & ~keep).sum()) / n,
            "clip_low_frac": float(clip_low.sum()) / n,
            "clip_high_frac": float(clip_high.sum()) / n,
            "clip_dual_frac": float(clip_dual.sum()) / n,
            "ratio_mean": r_mean,
            "ratio_max": r_max,
            "ratio_min": r_min,
            "kl_mean": kl_mean,
            "kl_max": kl_max,
            "tokens": float(valid.sum()),
        }
    return loss, metrics
