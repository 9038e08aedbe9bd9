"""The learner's tensor batch: prompt groups laid out for a forward pass over prompt + response.

Rows are samples (group after group). `input_ids` holds prompt then response, right-padded; every
per-token tensor (`loss_mask`, `behavior_logp`, `ref_logp`, and what a backend's `logprobs` returns) is
`[B, R]` over response positions only: column j of row i is response token j, predicted by the logits at
absolute position prompt_len[i] + j - 1. Advantages are Dr.GRPO, one per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from worker_contract.schema import RolloutRecord

from .algo import group_advantages


@dataclass
class TrainBatch:
    input_ids: torch.Tensor
    """[B, T] int64: prompt then response tokens, right-padded with pad_id."""
    attention_mask: torch.Tensor
    """[B, T] int64: 1 on real tokens."""
    prompt_lens: torch.Tensor
    """[B] int64: prompt length of each row (at least 1)."""
    response_lens: torch.Tensor
    """[B] int64: response length of each row."""
    loss_mask: torch.Tensor
    """[B, R] float: 1 where the token is trained on (the record's loss mask), 0 on padding."""
    behavior_logp: torch.Tensor
    """[B, R] float: log-probs the worker recorded when it sampled each token."""
    advantages: torch.Tensor
    """[B] float: Dr.GRPO advantage of each row."""
    rewards: torch.Tensor
    """[B] float: raw rewards."""
    ref_logp: torch.Tensor | None = None
    """[B, R] float: reference-policy log-probs, filled in by the learner before the step."""

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_response(self) -> int:
        return int(self.loss_mask.shape[1])

    def to(self, device: torch.device | str) -> TrainBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return TrainBatch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in moved.items()})

    def micro_batches(self, rows: int, max_tokens: int | None = None) -> list[TrainBatch]:
        """Consecutive rows in micro-batches of at most `rows` rows and, when `max_tokens` is given, at most
        that many padded tokens (rows x their longest sequence; a longer single row still goes alone)."""
        lengths = (self.prompt_lens + self.response_lens).tolist()
        out, start, longest = [], 0, 0
        for i, n in enumerate(lengths):
            longest = max(longest, int(n))
            count = i - start + 1
            if i > start and (count > rows or (max_tokens is not None and count * longest > max_tokens)):
                out.append(self.select(start, i))
                start, longest = i, int(n)
        if lengths:
            out.append(self.select(start, len(lengths)))
        return out

    def select(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop), trimmed to the longest sequence and response among them (a micro-batch)."""
        t = int((self.prompt_lens[start:stop] + self.response_lens[start:stop]).max())
        r = max(int(self.response_lens[start:stop].max()), 1)

        def cut(x: torch.Tensor | None, width: int) -> torch.Tensor | None:
            return None if x is None else x[start:stop, :width]

        return replace(
            self,
            input_ids=cut(self.input_ids, t), attention_mask=cut(self.attention_mask, t),
            prompt_lens=self.prompt_lens[start:stop], response_lens=self.response_lens[start:stop],
            loss_mask=cut(self.loss_mask, r), behavior_logp=cut(self.behavior_logp, r),
            advantages=self.advantages[start:stop], rewards=self.rewards[start:stop],
            ref_logp=cut(self.ref_logp, r),
        )

    def response_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, column j, position of the logits that predict it) for every response token."""
        r = self.max_response
        j = torch.arange(r, device=self.input_ids.device).expand(self.rows, r)
        valid = j < self.response_lens.unsqueeze(1)
        rows, cols = valid.nonzero(as_tuple=True)
        pos = self.prompt_lens[rows] + cols - 1
        return rows, cols, pos


def collate(records: Sequence[RolloutRecord], pad_id: int = 0) -> TrainBatch:
    """Lay out prompt groups as one batch; advantages are computed per group (Dr.GRPO)."""
    if not records:
        raise ValueError("collate needs at least one prompt group")
    n = len(records[0].samples)
    if any(len(r.samples) != n for r in records):
        raise ValueError("every group of a batch must have the same size (DRL_N_SAMPLES)")
    if any(not r.prompt_ids for r in records):
        raise ValueError("a prompt group with an empty prompt cannot be trained on (nothing predicts token 0)")
    flat = [s.reward for r in records for s in r.samples]
    rewards = torch.tensor(flat, dtype=torch.float32)
    adv = torch.tensor(group_advantages(flat, n), dtype=torch.float32)
    rows = [(r.prompt_ids, s) for r in records for s in r.samples]
    b = len(rows)
    t = max(len(p) + len(s.response_ids) for p, s in rows)
    rmax = max(max(len(s.response_ids) for _, s in rows), 1)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attn = torch.zeros((b, t), dtype=torch.long)
    loss_mask = torch.zeros((b, rmax), dtype=torch.float32)
    blp = torch.zeros((b, rmax), dtype=torch.float32)
    for i, (prompt, s) in enumerate(rows):
        seq = list(prompt) + list(s.response_ids)
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, : len(seq)] = 1
        k = len(s.response_ids)
        if k:
            loss_mask[i, :k] = torch.tensor(s.loss_mask, dtype=torch.float32)
            blp[i, :k] = torch.tensor(s.behavior_logprobs, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids, attention_mask=attn,
        prompt_lens=torch.tensor([len(p) for p, _ in rows], dtype=torch.long),
        response_lens=torch.tensor([len(s.response_ids) for _, s in rows], dtype=torch.long),
        loss_mask=loss_mask, behavior_logp=blp, advantages=adv, rewards=rewards,
    )
