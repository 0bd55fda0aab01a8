"""Routing replay's pieces that need no process group: the setting and its check, and the layout of a row's routed
experts in a micro-batch's flat token order (padded and packed), which the MoE routers replay."""

from __future__ import annotations

import pytest
import torch

from megatron_gigpo.actor.batching import build_micro_batch
from megatron_gigpo.algo.config import AlgorithmConfig, router_replay_errors
from megatron_gigpo.fields import field_errors

pytestmark = pytest.mark.unit

LAYERS, TOPK, EXPERTS = 3, 2, 8


def _rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 50, (n,), generator=g) for n in (5, 3, 7)]
    responses = [torch.randint(0, 50, (n,), generator=g) for n in (4, 2, 1)]
    # as the engine returns them: every token but the last response token, distinct top-k per (token, layer)
    routed = [torch.rand(p.numel() + r.numel() - 1, LAYERS, EXPERTS, generator=g).topk(TOPK, dim=-1).indices.to(
        torch.uint8) for p, r in zip(prompts, responses)]
    return prompts, responses, routed


def test_router_replay_setting_defaults_off_and_refuses_other_values():
    assert AlgorithmConfig().router_replay == "off"
    errors = field_errors(AlgorithmConfig(router_replay="record"))
    assert any("router_replay" in e and "record" in e for e in errors), errors


def test_router_replay_is_refused_for_a_dense_model_and_recomputed_pipeline_stages():
    assert router_replay_errors("off", num_experts=None, model="m", pipeline_stages=2, recompute_granularity="full") == []
    assert router_replay_errors("rollout", num_experts=4, model="m", pipeline_stages=1, recompute_granularity="full") == []
    (dense,) = router_replay_errors("rollout", num_experts=None, model="Qwen/Qwen3-8B", pipeline_stages=1,
                                    recompute_granularity=None)
    assert "algorithm.router_replay='rollout' needs a mixture-of-experts model" in dense and "Qwen/Qwen3-8B" in dense
    (pp,) = router_replay_errors("rollout", num_experts=4, model="m", pipeline_stages=2, recompute_granularity="full")
    assert "pipeline_model_parallel_size=2" in pp and "recompute_granularity=full" in pp


@pytest.mark.parametrize("packed", [False, True])
def test_routed_experts_land_on_the_tokens_the_decoder_routes(packed):
    """Token t of row b: the decoder output's flat index t * B + b (padded) or start_b + t (packed), where its
    hidden state (and so its MoE input) sits; tokens the engine did not route get experts 0..K-1."""
    prompts, responses, routed = _rows()
    rows = [2, 0, 1]
    mb = build_micro_batch(rows, prompts, responses, packed=packed, pad_to_multiple=4, routed_experts=routed)
    targets, replayed = mb.routed_experts
    flat_tokens = mb.input_ids.shape[1] * mb.input_ids.shape[0]
    assert targets.shape == (LAYERS, flat_tokens, TOPK) and targets.dtype == torch.int64
    assert replayed.shape == (flat_tokens,) and int(replayed.sum()) == sum(routed[r].shape[0] for r in rows)
    flat_ids = mb.input_ids.t().reshape(-1) if not packed else mb.input_ids.reshape(-1)
    start = 0
    for b, r in enumerate(rows):
        seq = torch.cat([prompts[r], responses[r]])
        t = torch.arange(routed[r].shape[0])
        flat = t * len(rows) + b if not packed else start + t
        assert torch.equal(flat_ids[flat], seq[: t.numel()])  # the same tokens ...
        assert torch.equal(targets[:, flat], routed[r].long().permute(1, 0, 2))  # ... carry the engine's experts
        last = (seq.numel() - 1) * len(rows) + b if not packed else start + seq.numel() - 1
        assert not replayed[last] and torch.equal(targets[:, last], torch.arange(TOPK).expand(LAYERS, TOPK))
        start += seq.numel()


def test_more_routed_tokens_than_the_row_has_is_refused():
    prompts, responses, routed = _rows()
    routed[0] = torch.zeros(prompts[0].numel() + responses[0].numel() + 1, LAYERS, TOPK, dtype=torch.uint8)
    with pytest.raises(ValueError, match="row 0: 10 routed tokens for a sequence of 9 tokens"):
        build_micro_batch([0], prompts, responses, packed=False, routed_experts=routed)


def test_a_dense_recipe_with_router_replay_is_refused_when_read():
    from pathlib import Path

    from megatron_gigpo.config import ConfigError, load_config

    recipe = Path(__file__).resolve().parents[2] / "recipes/alfworld/qwen2.5-7b-instruct.yaml"
    assert load_config(recipe, []).algorithm.router_replay == "off"
    with pytest.raises(ConfigError, match=r"algorithm.router_replay='rollout' needs a mixture-of-experts model; "
                                          r"'Qwen/Qwen2.5-7B-Instruct' is dense"):
        load_config(recipe, ["algorithm.router_replay=rollout"])


def test_the_actor_refuses_router_replay_on_a_dense_model_before_any_process_group(tmp_path):
    import torch.distributed as dist

    from actor.actor_helpers import actor_config  # tests/ is on the path
    from megatron_gigpo.actor.policy import PolicyActor
    from tiny_models import make_tiny_hf_model

    dense = make_tiny_hf_model(tmp_path, "qwen3", tie=True, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"algorithm.router_replay='rollout' needs a mixture-of-experts model"):
        PolicyActor(actor_config(dense, router_replay="rollout"))
    assert not dist.is_initialized()
