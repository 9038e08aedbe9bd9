"""The learner's objective inside slime: our functions (trainer/algo.py) on slime's custom-loss hooks.

slime's policy loss computes PPO with clip-higher (`--eps-clip`, `--eps-clip-high`) on the ratio to the
behaviour log-probs (`--use-rollout-logprobs`) and the low_var_kl (k3) term to the reference
(`--use-kl-loss`). Dual-clip (`--eps-clip-c`) depends on the commit: slime parses the flag at every commit,
but its policy loss passes it on only from 78156c53c (2026-08-12); before that (5c530c156, the image the
operator's guide names, included) our patch 0002 makes it pass it, applied only where slime's code drops
it (infra/patches/probes.py reads the call), so the loss below is dual-clip on every slime we launch on
(`nox -s slime_compat`, docs/slime.md). We plug in the rest (docs/slime.md):

* `drgrpo_rewards` (`--custom-reward-post-process-path`): Dr.GRPO advantages, reward minus group mean,
  with `algo.group_advantages` (as the native batch); called on the rollout side with the flat list of samples.
* `dppo_gate` (`--custom-tis-function-path`, active with `--get-mismatch-metrics`): the asymmetric DPPO
  mask with `algo.dppo_keep_mask`. slime hands a TIS function the per-token policy loss, the trainer's
  log-probs recomputed before the update (the current policy: one optimizer step per rollout) and the
  worker's log-probs, but not the advantages. Their sign is exactly recoverable: the dual-clip loss is
  -A*min(r, clip(r)) (< 0) for A > 0 and min(-A*max(..), -c*A) (> 0) for A < 0, with r > 0, so
  sign(A) = -sign(loss); A = 0 gives loss 0, which the gate treats as A <= 0, as algo.dppo_keep_mask does.
* `drgrpo_reducer` (`--custom-pg-loss-reducer-function-path`): sum of masked token losses divided by the
  constant max length. slime then scales each micro-batch by 1/global_batch_size (per-sample loss mode,
  i.e. without --calculate-per-token-loss), so the step's loss is sum(m*l) / (B * L_max), the Dr.GRPO form.

The KL term is slime's own: k3 (`low_var_kl`) reduced by `sum_of_sample_mean`, which slime rebuilds with
the masks our gate returns over the per-sample mask totals, so it is the per-sequence mean over the tokens
the gate keeps. `algo.policy_loss` reduces it the same way, so both engines optimise one objective
(tests/test_slime_plugin.py::test_engines_agree_on_loss_and_gradient checks loss and gradient).
"""

from __future__ import annotations

from typing import Any


def _ctx_algo():
    from .context import context

    return context().cfg.algo


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
