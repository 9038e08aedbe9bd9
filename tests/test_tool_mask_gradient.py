"""Tool tokens (loss mask 0: the retrieved documents of a psqa episode) are never trained on, in either engine:
d loss / d logp is exactly 0 at every mask-0 token, through the native step's objective (`step.loss_fn`, what
`train_on` hands the backend) and through the slime engine's loss arithmetic (our gate and reducer inside
slime's policy loss, as in test_slime_plugin's engines-agree test). The same batch with its masks set to 1
gives those tokens a gradient, so the checks fail if the mask were ignored."""

from __future__ import annotations

import random
import time

import torch

from tests.test_slime_plugin import RUN, SlimeSample, _slime_policy_loss, box, plugin, slime_args  # noqa: F401
from trainer.slime_plugin import context as plugin_context
from trainer.slime_plugin import objective
from worker_contract.schema import RolloutRecord, Sample, SamplingParams

N, SAMPLED, TOOL = 4, 3, 4
MAX_NEW = 2 * SAMPLED + TOOL


def _records(the_box, groups: int = 2, ignore_mask: bool = False) -> list[RolloutRecord]:
    """Episodes of 3 sampled tokens, a 4-token tool turn (log-prob 0.0, mask 0), 3 sampled tokens."""
    rng = random.Random(11)
    vocab = len(the_box["tok"])
    recs = []
    for g in range(groups):
        samples = []
        for i in range(N):
            resp = [rng.randrange(3, vocab) for _ in range(MAX_NEW)]
            mask = [1] * SAMPLED + [0] * TOOL + [1] * SAMPLED
            blp = [-rng.uniform(0.1, 3.0) if m else 0.0 for m in mask]
            samples.append(Sample(response_ids=resp, behavior_logprobs=blp,
                                  loss_mask=[1] * MAX_NEW if ignore_mask else mask, reward=float((i + g) % 2),
                                  finish_reason="stop"))
        recs.append(RolloutRecord(run=RUN, worker_id="w1", group_id=f"tool-{g}", policy_version=1, plane="bf16",
                                  task="arithmetic", prompt_id=f"p-{g}", prompt_ids=[5, 6, 7],
                                  sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW),
                                  samples=samples, created_at=time.time()))
    return recs


TOOL_COLS = slice(SAMPLED, SAMPLED + TOOL)


def _native_grad(records, algo) -> torch.Tensor:
    from trainer import step
    from trainer.step import collate

    tb = collate(records)
    g = torch.Generator().manual_seed(3)
    target = -torch.rand(tb.behavior_logp.shape, generator=g) * 3 - 0.05  # the policy's log-probs, every token
    tb.ref_logp = -torch.rand(tb.behavior_logp.shape, generator=g) * 3 - 0.05
    theta = torch.zeros_like(target, requires_grad=True)
    loss, _ = step.loss_fn(algo)(target + theta, tb)
    loss.backward()
    return theta.grad


def _slime_grad(records, algo) -> torch.Tensor:
    from trainer.rollouts.pool import Group
    from trainer.slime_plugin.rollout import group_to_samples

    samples = [s for gi, r in enumerate(records)
               for s in group_to_samples(Group(f"k{gi}", r, 1, 0), group_index=gi, first_index=gi * N,
                                         Sample=SlimeSample)]
    _, adv_flat = objective.drgrpo_rewards(slime_args(), samples)
    g = torch.Generator().manual_seed(3)
    lens = [s.response_length for s in samples]
    target = -torch.rand((len(samples), MAX_NEW), generator=g) * 3 - 0.05
    ref_all = -torch.rand((len(samples), MAX_NEW), generator=g) * 3 - 0.05
    theta = torch.zeros_like(target, requires_grad=True)
    mu = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]
    logp = [target[i, :n] + theta[i, :n] for i, n in enumerate(lens)]
    ref = [ref_all[i, :n] for i, n in enumerate(lens)]
    adv = [torch.full((n,), adv_flat[i]) for i, n in enumerate(lens)]
    masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
    args = slime_args(eps_clip=algo.eps_clip, eps_clip_high=algo.eps_clip_high, eps_clip_c=algo.eps_clip_c,
                      kl_loss_coef=algo.kl_coef)
    loss = _slime_policy_loss(args, list(range(len(samples))), logp, mu, ref, adv, masks,
                              [sum(s.loss_mask) for s in samples])
    loss.backward()
    return theta.grad


def test_tool_tokens_get_exactly_zero_gradient_in_both_engines(box, plugin):  # noqa: F811
    ctx = plugin_context.context()
    algo = ctx.cfg.algo.model_copy(update={"kl_coef": 0.5, "max_new_tokens": MAX_NEW})
    ctx.cfg = ctx.cfg.model_copy(update={"algo": algo})
    for name, grad_of in (("native", _native_grad), ("slime", _slime_grad)):
        grad = grad_of(_records(box), algo)
        assert torch.all(grad[:, TOOL_COLS] == 0), f"{name}: a tool token got a gradient"
        assert torch.count_nonzero(grad[:, :SAMPLED]) > 0 and torch.count_nonzero(grad[:, -SAMPLED:]) > 0, name
        ignored = grad_of(_records(box, ignore_mask=True), algo)  # the check would catch an ignored mask
        assert torch.count_nonzero(ignored[:, TOOL_COLS]) > 0, name
