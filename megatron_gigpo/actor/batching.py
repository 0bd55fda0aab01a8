"""Rows -> micro-batches for the Megatron actor: token-budget planning, data-parallel split and the
tensors one micro-batch feeds to ``GPTModel``.

A row is ``prompt_ids ++ response_ids`` (length ``P + R``). The log-prob of response token ``j`` comes from
the hidden state at position ``P - 1 + j`` (next-token prediction), so each micro-batch carries the flat
indices of those positions in the decoder output and the response tokens as labels; the output layer is
then applied to response positions only (prompts in multi-turn agents are long, responses short).

Two layouts:

- ``padded``: rows right-padded to the micro-batch's longest row, decoder output (S, B, H). With right
  padding, causal attention never lets a real token see padding, so no attention mask is needed.
  This is the layout on CPU: Megatron's local ``DotProductAttention`` rejects ``PackedSeqParams``.
- ``thd``: rows concatenated into one sequence (1, T) with ``PackedSeqParams(qkv_format="thd")``
  (cumulative sequence lengths); needs Transformer-Engine attention. Decoder output (T, 1, H).

The token budget counts what the layout computes on: ``rows x longest`` for padded, the plain sum for thd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["MicroBatch", "plan_micro_batches", "split_rows_balanced", "build_micro_batch", "split_mini_batches",
           "num_mini_batches", "update_is_on_policy"]


@dataclass
class MicroBatch:
    """Model inputs and response bookkeeping of one micro-batch.

    Attributes:
        rows: indices (into the caller's row list) of the rows in this micro-batch, in order.
        input_ids: int64 (B, S) padded, or (1, T) packed.
        position_ids: int64, same shape as ``input_ids`` (positions restart at 0 in every row).
        packed_seq_params: ``PackedSeqParams`` for the thd layout, else None.
        hidden_index: int64 (N,), for every response token of every row (row-major), the flat index
            into the decoder output viewed as (S * B, H) of the position that predicts it.
        labels: int64 (N,), the response token ids.
        response_lengths: per row, the number of response tokens R_i (sum = N).
        stand_in: a copy of another rank's row that only keeps this rank in step with its expert-parallel peers
            (each MoE layer's token dispatch is a collective of the expert-parallel group, so its ranks run the
            same number of micro-batches): loss multiplied by zero, outputs dropped.
        routed_experts: routing replay: int64 (L, S * B, K) (packed: (L, T, K)) expert ids per layer and token in
            the decoder's flat order, and bool (S * B,) / (T,) marking the tokens the engine routed
            (:func:`megatron_gigpo.actor.router_replay.micro_batch_targets`); None without replay.
    """

    rows: list[int]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: object | None
    hidden_index: torch.Tensor
    labels: torch.Tensor
    response_lengths: list[int]
    stand_in: bool = False
    routed_experts: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_response_tokens(self) -> int:
        return int(self.labels.numel())

    def to(self, device: torch.device) -> "MicroBatch":
        """A copy with tensors on ``device`` (PackedSeqParams tensors included)."""
        params = self.packed_seq_params
        if params is not None:
            from megatron.core.packed_seq_params import PackedSeqParams

            params = PackedSeqParams(
                qkv_format=params.qkv_format,
                cu_seqlens_q=params.cu_seqlens_q.to(device),
                cu_seqlens_kv=params.cu_seqlens_kv.to(device),
                max_seqlen_q=params.max_seqlen_q,
                max_seqlen_kv=params.max_seqlen_kv,
            )
        return MicroBatch(
            rows=self.rows,
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            packed_seq_params=params,
            hidden_index=self.hidden_index.to(device),
            labels=self.labels.to(device),
            response_lengths=self.response_lengths,
            stand_in=self.stand_in,
            routed_experts=None if self.routed_experts is None else tuple(t.to(device) for t in self.routed_experts),
        )


def plan_micro_batches(lengths: Sequence[int], token_budget: int, *, padded: bool) -> list[list[int]]:
    """Group rows into micro-batches that fit ``token_budget`` (dynamic batch size).

    Rows are taken longest first (ties by index, so the plan is deterministic) and added to the current
    micro-batch while its cost stays within the budget: ``count x longest`` when ``padded``, else the sum
    of lengths. Sorting by length keeps padding small. A row longer than the budget gets a micro-batch of
    its own (the budget bounds memory; refusing the row would abort a training run mid-way).

    Args:
        lengths: per row, prompt + response tokens (>= 1).
        token_budget: tokens per micro-batch (>= 1).
        padded: cost model of the padded layout (True) or of the packed one (False).

    Returns:
        Lists of row indices; every index appears exactly once; empty for no rows.

    Raises:
        ValueError: ``token_budget < 1`` or a length < 1.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget={token_budget} must be >= 1")
    bad = [i for i, n in enumerate(lengths) if n < 1]
    if bad:
        raise ValueError(f"rows {bad[:5]} have length < 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for i in order:
        n = int(lengths[i])
        cost = max(longest, n) * (len(current) + 1) if padded else total + n
        if current and cost > token_budget:
            groups.append(current)
            current, longest, total = [], 0, 0
        current.append(i)
        longest, total = max(longest, n), total + n
    if current:
        groups.append(current)
    return groups


def split_rows_balanced(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Split rows into ``parts`` groups of balanced token count (for data-parallel ranks).

    Greedy longest-processing-time: rows longest first, each to the group with the fewest tokens (ties:
    fewer rows, then lower group index). Deterministic, so every rank computes the same split. Each
    group's indices are returned sorted. Every group gets a row while rows last: with fewer rows than parts
    the last ``parts - len(lengths)`` groups are empty (the actor runs a zero-weight stand-in row there, so
    that such a rank still takes part in the collectives).

    Raises:
        ValueError: ``parts < 1``.
    """
    if parts < 1:
        raise ValueError(f"parts={parts} must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = [[] for _ in range(parts)]
    tokens = [0] * parts
    for i in order:
        g = min(range(parts), key=lambda k: (tokens[k], len(groups[k]), k))
        groups[g].append(i)
        tokens[g] += int(lengths[i])
    return [sorted(g) for g in groups]


def split_mini_batches(num_rows: int, mini_batch_size: int, generator: torch.Generator | None) -> list[list[int]]:
    """Row indices of the mini-batches of one epoch: ``ceil(num_rows / mini_batch_size)`` mini-batches of
    near-equal size (differing by at most one row, none larger than ``mini_batch_size``), after a random
    permutation when ``generator`` is given.

    Raises:
        ValueError: ``num_rows < 1`` or ``mini_batch_size < 1``.
    """
    count = num_mini_batches(num_rows, mini_batch_size)
    order = torch.randperm(num_rows, generator=generator) if generator is not None else torch.arange(num_rows)
    return [chunk.tolist() for chunk in torch.tensor_split(order, count)]


def num_mini_batches(num_rows: int, mini_batch_size: int) -> int:
    """Mini-batches (optimizer steps) of one epoch over ``num_rows`` rows: ``ceil(num_rows / mini_batch_size)``,
    the count :func:`split_mini_batches` splits into.

    Raises:
        ValueError: ``num_rows < 1`` or ``mini_batch_size < 1``.
    """
    if num_rows < 1 or mini_batch_size < 1:
        raise ValueError(f"num_rows={num_rows} and mini_batch_size={mini_batch_size} must be >= 1")
    return -(-num_rows // mini_batch_size)


def update_is_on_policy(num_rows: int, trainer) -> bool:
    """Whether an update over ``num_rows`` rows takes exactly one optimizer step, so that the behaviour policy
    is the policy being trained: ``trainer.ppo_epochs == 1`` and every row fits in one mini-batch of
    ``trainer.ppo_mini_batch_size`` (verl's ``on_policy`` in its dp_actor).

    Then the old log-probs equal the current policy's and need no forward pass of their own: the update uses
    each micro-batch's ``log_prob.detach()`` (importance ratio exactly 1). The driver and
    :meth:`PolicyActor.update <megatron_gigpo.actor.policy.PolicyActor.update>` both ask this function.

    Args:
        num_rows: training rows of the iteration (>= 1).
        trainer: the recipe's ``trainer`` section (:class:`megatron_gigpo.run.config.TrainerConfig`).

    Raises:
        ValueError: ``num_rows < 1`` or ``ppo_mini_batch_size < 1``.
    """
    return trainer.ppo_epochs == 1 and num_mini_batches(num_rows, trainer.ppo_mini_batch_size) == 1


def build_micro_batch(
    rows: Sequence[int],
    prompt_ids: Sequence[torch.Tensor],
    response_ids: Sequence[torch.Tensor],
    *,
    packed: bool,
    pad_token_id: int = 0,
    pad_to_multiple: int = 1,
    routed_experts: Sequence[torch.Tensor] | None = None,
) -> MicroBatch:
    """Model inputs for ``rows`` (indices into ``prompt_ids`` / ``response_ids``).

    Args:
        rows: row indices, in the order they are laid out.
        prompt_ids, response_ids: per row, int64 (P_i,) with P_i >= 1 and (R_i,) token ids.
        packed: thd layout (one packed sequence) instead of padded (see module docstring).
        pad_token_id: id written into padding (never attended by real tokens, never a label).
        pad_to_multiple: the sequence dimension (padded: the longest row; packed: the total) is padded to a
            multiple of this (sequence parallelism splits it over the TP ranks). Packed, the padding is one
            more sequence of its own after the rows.
        routed_experts: routing replay: per row of the batch, integer (T_i, L, K) expert ids of its first T_i
            tokens, laid out into :attr:`MicroBatch.routed_experts`; None: no replay.

    Raises:
        ValueError: a row has an empty prompt (the first response token would have no predictor).
    """
    seqs, prompt_lens, resp_lens = [], [], []
    for r in rows:
        p, a = prompt_ids[r].reshape(-1).long(), response_ids[r].reshape(-1).long()
        if p.numel() < 1:
            raise ValueError(f"row {r}: empty prompt_ids; a response token needs a preceding token")
        seqs.append(torch.cat([p, a]))
        prompt_lens.append(int(p.numel()))
        resp_lens.append(int(a.numel()))
    lens = [int(s.numel()) for s in seqs]
    labels = torch.cat([response_ids[r].reshape(-1).long() for r in rows]) if rows else torch.empty(0, dtype=torch.long)
    packed_params = None
    if packed:
        from megatron.core.packed_seq_params import PackedSeqParams

        extra = -sum(lens) % pad_to_multiple
        pieces = lens + ([extra] if extra else [])
        input_ids = torch.cat(seqs + [torch.full((extra,), pad_token_id, dtype=torch.long)]).unsqueeze(0)  # (1, T)
        position_ids = torch.cat([torch.arange(n) for n in pieces]).unsqueeze(0)
        starts = torch.tensor([0] + lens).cumsum(0)
        cu = torch.tensor([0] + pieces).cumsum(0).to(torch.int32)
        packed_params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(pieces), max_seqlen_kv=max(pieces)
        )
        # decoder output (T, 1, H): flat index = packed position
        index = [starts[b] + prompt_lens[b] - 1 + torch.arange(resp_lens[b]) for b in range(len(rows))]
    else:
        batch, seq = len(rows), -(-max(lens) // pad_to_multiple) * pad_to_multiple
        input_ids = torch.full((batch, seq), pad_token_id, dtype=torch.long)
        for b, s in enumerate(seqs):
            input_ids[b, : s.numel()] = s
        position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()
        # decoder output (S, B, H): flat index = position * B + row
        index = [(prompt_lens[b] - 1 + torch.arange(resp_lens[b])) * batch + b for b in range(batch)]
    hidden_index = torch.cat(index).long() if index else torch.empty(0, dtype=torch.long)
    replay = None
    if routed_experts is not None:
        from megatron_gigpo.actor.router_replay import micro_batch_targets

        seq_lens = {r: n for r, n in zip(rows, lens)}
        replay = micro_batch_targets(rows, routed_experts, seq_lens, seq=int(input_ids.shape[1]),
                                     packed_starts=[int(x) for x in starts[:-1]] if packed else None)
    return MicroBatch(
        rows=list(rows),
        input_ids=input_ids,
        position_ids=position_ids,
        packed_seq_params=packed_params,
        hidden_index=hidden_index,
        labels=labels,
        response_lengths=resp_lens,
        routed_experts=replay,
    )
