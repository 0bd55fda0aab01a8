"""Micro-batch planning, data-parallel split, mini-batches and micro-batch tensors (no model)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_gigpo.actor.batching import (
    build_micro_batch,
    num_mini_batches,
    plan_micro_batches,
    split_mini_batches,
    split_rows_balanced,
    update_is_on_policy,
)

lengths_strategy = st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30)


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(lengths=lengths_strategy, budget=st.integers(min_value=1, max_value=120), padded=st.booleans())
def test_plan_covers_every_row_once_within_budget(lengths, budget, padded):
    groups = plan_micro_batches(lengths, budget, padded=padded)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        cost = max(lengths[i] for i in g) * len(g) if padded else sum(lengths[i] for i in g)
        # only a single row longer than the budget may exceed it
        assert cost <= budget or len(g) == 1
    assert plan_micro_batches(lengths, budget, padded=padded) == groups  # deterministic


@pytest.mark.unit
def test_plan_sorts_longest_first_and_counts_padding():
    lengths = [3, 10, 4, 9]
    assert plan_micro_batches(lengths, 20, padded=True) == [[1, 3], [2, 0]]
    # padded cost is rows x longest: 10 x 3 > 29; packed cost is the plain sum: 10 + 9 + 4 = 23 <= 23
    assert plan_micro_batches(lengths, 29, padded=True) == [[1, 3], [2, 0]]
    assert plan_micro_batches(lengths, 22, padded=False) == [[1, 3], [2, 0]]
    assert plan_micro_batches(lengths, 23, padded=False) == [[1, 3, 2], [0]]
    assert plan_micro_batches([50, 2], 8, padded=True) == [[0], [1]]  # oversized row alone
    assert plan_micro_batches([], 8, padded=True) == []
    with pytest.raises(ValueError, match="token_budget"):
        plan_micro_batches([1], 0, padded=True)
    with pytest.raises(ValueError, match="length < 1"):
        plan_micro_batches([1, 0], 5, padded=True)


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(lengths=lengths_strategy, parts=st.integers(min_value=1, max_value=4))
def test_split_rows_balanced(lengths, parts):
    groups = split_rows_balanced(lengths, parts)
    assert len(groups) == parts
    if len(lengths) < parts:  # one row per group while rows last, then empty groups
        assert [len(g) for g in groups] == [1] * len(lengths) + [0] * (parts - len(lengths))
        return
    assert all(groups)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    tokens = [sum(lengths[i] for i in g) for g in groups]
    # greedy LPT: the fullest group exceeds the emptiest by at most one row
    assert max(tokens) - min(tokens) <= max(lengths)


@pytest.mark.unit
def test_split_mini_batches_counts_rows():
    batches = split_mini_batches(10, 4, None)
    assert batches == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]  # ceil(10 / 4) = 3, near-equal, <= 4
    assert split_mini_batches(8, 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_mini_batches(3, 8, None) == [[0, 1, 2]]
    a = split_mini_batches(10, 4, torch.Generator().manual_seed(3))
    b = split_mini_batches(10, 4, torch.Generator().manual_seed(3))
    assert a == b and sorted(i for m in a for i in m) == list(range(10)) and a != batches
    with pytest.raises(ValueError, match="mini_batch_size"):
        split_mini_batches(10, 0, None)


def _rows():
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]
    responses = [torch.tensor([11, 12]), torch.tensor([13, 14, 15]), torch.tensor([], dtype=torch.long)]
    return prompts, responses


@pytest.mark.unit
def test_build_padded_micro_batch_indexes_predicting_positions():
    prompts, responses = _rows()
    mb = build_micro_batch([1, 0, 2], prompts, responses, packed=False, pad_token_id=0)
    assert mb.input_ids.tolist() == [[8, 13, 14, 15, 0], [5, 6, 7, 11, 12], [9, 10, 0, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 3
    assert mb.response_lengths == [3, 2, 0] and mb.labels.tolist() == [13, 14, 15, 11, 12]
    batch = mb.input_ids.shape[0]
    tokens_sb = mb.input_ids.t().reshape(-1)  # decoder output layout (S, B) flattened
    # the position at hidden_index predicts the token one position later in the same row
    assert tokens_sb[mb.hidden_index + batch].tolist() == mb.labels.tolist()
    assert mb.packed_seq_params is None


@pytest.mark.unit
def test_build_packed_micro_batch_uses_cu_seqlens():
    prompts, responses = _rows()
    mb = build_micro_batch([0, 1], prompts, responses, packed=True)
    assert mb.input_ids.tolist() == [[5, 6, 7, 11, 12, 8, 13, 14, 15]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    params = mb.packed_seq_params
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 5, 9] and params.max_seqlen_q == 5
    flat = mb.input_ids.reshape(-1)
    assert flat[mb.hidden_index + 1].tolist() == mb.labels.tolist() == [11, 12, 13, 14, 15]


@pytest.mark.unit
def test_sequence_parallel_pads_the_sequence_to_a_multiple_of_tp():
    prompts, responses = _rows()
    padded = build_micro_batch([1, 0, 2], prompts, responses, packed=False, pad_to_multiple=4)
    plain = build_micro_batch([1, 0, 2], prompts, responses, packed=False)
    assert padded.input_ids.shape == (3, 8) and padded.input_ids[:, :5].tolist() == plain.input_ids.tolist()
    # the same positions predict the same labels in the longer (S, B) layout (index = position x B + row)
    assert padded.hidden_index.tolist() == plain.hidden_index.tolist()
    packed = build_micro_batch([0, 1], prompts, responses, packed=True, pad_to_multiple=4)
    assert packed.input_ids.tolist() == [[5, 6, 7, 11, 12, 8, 13, 14, 15, 0, 0, 0]]  # 9 -> 12 tokens
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]
    assert packed.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 9, 12]  # the padding: a sequence of its own
    unpadded = build_micro_batch([0, 1], prompts, responses, packed=True)
    assert packed.hidden_index.tolist() == unpadded.hidden_index.tolist()


@pytest.mark.unit
def test_build_rejects_empty_prompt():
    with pytest.raises(ValueError, match="row 0: empty prompt_ids"):
        build_micro_batch([0], [torch.tensor([], dtype=torch.long)], [torch.tensor([1])], packed=False)


@pytest.mark.unit
def test_on_policy_means_one_epoch_of_one_mini_batch():
    from megatron_gigpo.config import TrainerConfig

    def trainer(epochs, size):
        return TrainerConfig(ppo_epochs=epochs, ppo_mini_batch_size=size)

    for rows, size in ((1, 1), (8, 8), (3, 8)):
        assert num_mini_batches(rows, size) == len(split_mini_batches(rows, size, None)) == 1
        assert update_is_on_policy(rows, trainer(1, size))
        assert not update_is_on_policy(rows, trainer(2, size))
    assert num_mini_batches(9, 8) == len(split_mini_batches(9, 8, None)) == 2
    assert not update_is_on_policy(9, trainer(1, 8))
    with pytest.raises(ValueError, match="num_rows=0"):
        update_is_on_policy(0, trainer(1, 8))
