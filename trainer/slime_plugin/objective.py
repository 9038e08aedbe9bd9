"""The learner's objective inside slime: our functions (trainer/algo.py) on slime's custom-loss hooks.

slime computes PPO with clip-higher and dual-clip on the ratio to the behaviour log-probs, and the k3 KL to
the reference; we plug in Dr.GRPO advantages (`drgrpo_rewards`), the asymmetric DPPO gate (`dppo_gate`)
and the Dr.GRPO constant-length reducer (`drgrpo_reducer`), so both engines optimise one objective
(tests/test_slime_plugin.py::test_engines_agree_on_loss_and_gradient).
More in docs/slime.md (module notes).
"""

from __future__ import annotations

from typing import Any


def _ctx_algo():
    from trainer.objectives import check_engine

    from .context import context

    algo = context().cfg.algo
    check_engine(algo.objective, "slime")  # a recipe objective slime's hooks do not build: refused, one sentence
    return algo


def drgrpo_rewards(args: Any, samples: list) -> tuple[list[float], list[float]]:
    """(raw rewards, Dr.GRPO advantages) for the flat, group-contiguous list of samples."""
    from trainer.algo import group_advantages

    n = int(getattr(args, "n_samples_per_prompt", 0) or 0)
    if n < 1 or len(samples) % n:
        raise ValueError(f"{len(samples)} samples do not split into groups of --n-samples-per-prompt {n}; the "
                         "rollout function returns whole, contiguous groups")
    raw = [float(s.reward if not isinstance(s.reward, dict) else s.reward[args.reward_key]) for s in samples]
    return raw, group_advantages(raw, n)


def dppo_gate(args: Any, *, pg_loss, train_log_probs: list, rollout_log_probs: list, loss_masks: list,
              **kwargs: Any):
    """slime TIS hook: zero the loss of tokens the asymmetric DPPO gate drops; returns (loss, masks, metrics)."""
    import torch

    from trainer.algo import dppo_keep_mask

    gate = _ctx_algo().gate
    logp = torch.cat(train_log_probs, dim=0).detach()
    mu = torch.cat(rollout_log_probs, dim=0).to(logp.device)
    if logp.shape != pg_loss.shape or mu.shape != pg_loss.shape:
        raise ValueError(f"DPPO gate: loss {tuple(pg_loss.shape)}, log-probs {tuple(logp.shape)} and behaviour "
                         f"log-probs {tuple(mu.shape)} must align token for token")
    adv_sign = -torch.sign(pg_loss.detach())  # exact: see the module docstring
    keep = dppo_keep_mask(logp, mu, adv_sign, gate.delta_low, gate.delta_high, gate.divergence)
    sizes = [t.numel() for t in train_log_probs]
    masks = [m * k.to(m.dtype) for m, k in zip(loss_masks, keep.split(sizes), strict=True)]
    gated = pg_loss * keep.to(pg_loss.dtype)
    return gated, masks, {"dppo_drop_frac": (~keep).to(pg_loss.dtype).detach()}


def drgrpo_reducer(total_lengths: list[int], response_lengths: list[int], loss_masks: list,
                   calculate_per_token_loss: bool):
    """slime pg-loss reducer factory: x -> sum over samples of sum(mask * x) / max_new_tokens."""
    if calculate_per_token_loss:
        raise ValueError("the Dr.GRPO reducer needs slime's per-sample loss scaling: drop --calculate-per-token-loss")
    max_len = _ctx_algo().max_new_tokens

    def reduce(x):
        import torch

        from trainer.algo import drgrpo_reduce

        if x.numel() != sum(int(m.numel()) for m in loss_masks):
            raise ValueError("the Dr.GRPO reducer supports --context-parallel-size 1 only (the loss and the "
                             "masks differ in length)")
        rows = len(loss_masks)
        width = max((int(m.numel()) for m in loss_masks), default=0)
        values = x.new_zeros((rows, width))
        mask = x.new_zeros((rows, width))
        for i, (xi, mi) in enumerate(zip(x.split([int(m.numel()) for m in loss_masks]), loss_masks, strict=True)):
            values[i, : xi.numel()] = xi
            mask[i, : mi.numel()] = mi.to(x.dtype)
        # drgrpo_reduce divides by rows * max_len; slime divides by the global batch afterwards, so undo rows
        return drgrpo_reduce(values, mask, max_len) * rows if rows else torch.zeros((), device=x.device)

    return reduce
