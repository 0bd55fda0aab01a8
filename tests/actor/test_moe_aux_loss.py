"""The MoE load-balancing loss as a metric (``actor/moe_aux_loss``): a tiny Qwen3-MoE at EP2 on two gloo ranks
reports megatron-core's tracked loss, which equals transformers' ``load_balancing_loss_func`` on the same router
logits divided by the experts per token (per layer and micro-batch; then the mean over layers, micro-batches and
ranks); absent with a zero coefficient and for a dense model."""

from __future__ import annotations

import pytest
import torch
from actor_helpers import actor_config, make_batch, row_advantages, start_rank
from multiproc import spawn
from tiny_models import TINY_MOE, make_tiny_hf_model

pytestmark = [pytest.mark.multiprocess]

ROWS = 5  # at micro_batch_tokens=1 one row per micro-batch: the ranks run different numbers of real rows


def _update(model_dir, **settings) -> tuple[dict, list]:
    """One update of a DP2 actor; returns its metrics and this rank's micro-batches' (input_ids, position_ids)."""
    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.policy import PolicyActor, _lengths

    batch = make_batch(ROWS)
    actor = PolicyActor(actor_config(model_dir, micro_batch_tokens=1, log_prob_micro_batch_tokens=1, shuffle=False,
                                     use_kl_loss=False, **settings))
    resp = [int(r.numel()) for r in batch.response_ids]
    plan, _ = actor._mini_batch_plan(batch, _lengths(batch.prompt_ids, batch.response_ids), resp, list(range(ROWS)))
    inputs = [(mb.input_ids.clone(), mb.position_ids.clone()) for mb in plan.micro_batches]
    metrics, _ = actor.update(batch, row_advantages(batch), actor.compute_log_probs(batch))
    del actor
    distributed.destroy()
    return metrics, inputs


def _ranks(rank: int, world_size: int, moe_dir, dense_dir) -> dict:
    from megatron_gigpo.actor import distributed

    start_rank()
    out = {}
    out["moe"] = _update(moe_dir, expert_model_parallel_size=2, moe_aux_loss_coeff=0.01)
    out["moe_off"] = _update(moe_dir, expert_model_parallel_size=2, moe_aux_loss_coeff=0.0)[0]
    out["dense"] = _update(dense_dir, moe_aux_loss_coeff=0.01)[0]
    distributed.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_aux_loss")
    moe_dir = make_tiny_hf_model(root, "qwen3_moe", tie=True, vocab_size=511, seed=4)
    dense_dir = make_tiny_hf_model(root, "qwen2", tie=True, vocab_size=511)
    return moe_dir, spawn(_ranks, 2, moe_dir, dense_dir, timeout=900)


def _hf_aux_loss(model, input_ids: torch.Tensor, position_ids: torch.Tensor) -> float:
    """Mean over layers of transformers' Qwen3-MoE load-balancing loss of one layer's router logits, divided by
    the experts per token (its expert fractions sum to k, megatron-core's to 1)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    k, experts = TINY_MOE["num_experts_per_tok"], TINY_MOE["num_experts"]
    with torch.no_grad():
        logits = model(input_ids, position_ids=position_ids, output_router_logits=True).router_logits
    per_layer = [float(load_balancing_loss_func((layer,), experts, k)) / k for layer in logits]
    return sum(per_layer) / len(per_layer)


def test_logged_aux_loss_equals_transformers_load_balancing_loss(runs):
    from transformers import AutoModelForCausalLM

    moe_dir, results = runs
    model = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    # per rank: the mean over its micro-batches (a stand-in included); then the mean over the two ranks
    per_rank = []
    for result in results:
        _, inputs = result["moe"]
        per_rank.append(sum(_hf_aux_loss(model, ids, pos) for ids, pos in inputs) / len(inputs))
    expected = sum(per_rank) / len(per_rank)
    for result in results:
        logged = result["moe"][0]["actor/moe_aux_loss"]
        assert logged == pytest.approx(expected, rel=1e-5, abs=1e-6), (logged, expected, per_rank)
    assert 0.0 < expected <= TINY_MOE["num_experts"] / TINY_MOE["num_experts_per_tok"]  # at most E / k


def test_aux_loss_is_absent_without_coefficient_and_for_dense_models(runs):
    _, results = runs
    for result in results:
        assert "actor/moe_aux_loss" not in result["moe_off"], sorted(result["moe_off"])
        assert "actor/moe_aux_loss" not in result["dense"], sorted(result["dense"])
        assert "actor/pg_loss" in result["dense"]
