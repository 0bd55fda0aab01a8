"""Optimizer, gradient and parameter bytes of the memory estimate (megatron_gigpo.cluster.memory) against real Megatron
ranks: a tiny Qwen2 model in bfloat16 on two gloo ranks, at DP2 without and with the distributed optimizer and
at PP2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from multiproc import spawn
from tiny_models import make_tiny_hf_model

from megatron_gigpo.cluster.memory import optimizer_bytes_per_param, rank_parameter_count

pytestmark = pytest.mark.multiprocess



def _step_with_zero_gradients(actor) -> list:
    """One optimizer step on zero gradients, so that Adam allocates its moments; returns the inner optimizers."""
    import torch

    inner = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    for opt in inner:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        opt.optimizer.step()
    return inner


def _moment_bytes(inner: list) -> int:
    """Bytes of Adam's ``exp_avg`` and ``exp_avg_sq`` over the inner optimizers."""
    return sum(t.numel() * t.element_size() for opt in inner for st in opt.optimizer.state.values()
               for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))

def _megatron_rank(rank: int, world_size: int, model_dir: Path) -> list[dict]:
    """Real Megatron ranks (DP2, then PP2): parameter count, gradient buffer and Adam state bytes per rank."""
    import torch
    import torch.distributed as dist

    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.config import ActorConfig
    from megatron_gigpo.actor.policy import PolicyActor

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out = []
    for pp, distributed_optimizer in ((1, False), (1, True), (2, True)):
        config = ActorConfig.build(model_dir, params_dtype="bfloat16", pipeline_model_parallel_size=pp,
                                   use_distributed_optimizer=distributed_optimizer, use_kl_loss=False)
        actor = PolicyActor(config)
        module = actor.model_chunks[0].module
        inner = _step_with_zero_gradients(actor)
        model_storage = {p.untyped_storage().data_ptr() for p in module.parameters()}
        model_storage |= {b.param_data.untyped_storage().data_ptr() for b in actor.model_chunks[0].buffers
                          if b.param_data is not None}
        masters = [p for opt in inner for g in opt.optimizer.param_groups for p in g["params"]]
        out.append({
            "pp": pp, "distributed_optimizer": distributed_optimizer,
            "stage": distributed.parallel_state.get_pipeline_model_parallel_rank(),
            "params": sum(p.numel() for p in module.parameters()),
            "bf16_params": sum(p.numel() for p in module.parameters() if p.dtype == torch.bfloat16),
            "grad_buffer": sum(b.grad_data.numel() * b.grad_data.element_size() for b in actor.model_chunks[0].buffers),
            "moments": _moment_bytes(inner),
            "master_copy": sum(p.numel() * p.element_size() for p in masters
                               if p.untyped_storage().data_ptr() not in model_storage),
        })
        del actor
        distributed.destroy()
    return out


def test_optimizer_and_gradient_bytes_match_real_megatron_ranks(tmp_path):
    model_dir = make_tiny_hf_model(tmp_path, "qwen2", tie=False)
    hf = json.loads((model_dir / "config.json").read_text())
    runs = spawn(_megatron_rank, 2, model_dir, timeout=900)
    per_param = optimizer_bytes_per_param("bfloat16")  # two fp32 moments + the fp32 master copy of bf16 params
    for layout in range(3):
        ranks = [runs[r][layout] for r in range(2)]
        pp, dist_opt = ranks[0]["pp"], ranks[0]["distributed_optimizer"]
        dp = 2 // pp
        for r in ranks:
            params = rank_parameter_count(hf, 1, pp, r["stage"])
            assert r["params"] == params, (layout, r)
            assert 4 * params <= r["grad_buffer"] <= 4 * params * 1.01  # fp32 main_grad (+ bucket padding)
        # Adam's moments and the master copy, summed over the data-parallel ranks that shard them.
        for stage_ranks in ([r for r in ranks if r["stage"] == s] for s in range(pp)):
            params = rank_parameter_count(hf, 1, pp, stage_ranks[0]["stage"])
            copies = 1 if dist_opt else dp  # without the distributed optimizer every DP rank holds all of it
            assert sum(r["moments"] for r in stage_ranks) == 8 * params * copies
            # The master copy is fp32 for the bf16 parameters (Megatron keeps the norms' gains in fp32 on CPU).
            assert sum(r["master_copy"] for r in stage_ranks) == 4 * stage_ranks[0]["bf16_params"] * copies
            assert stage_ranks[0]["bf16_params"] >= 0.99 * params
            # The estimate: optimizer_bytes_per_param x P_s (x DP copies without the distributed optimizer).
            real = sum(r["moments"] + r["master_copy"] for r in stage_ranks)
            assert real == pytest.approx(per_param * params * copies, rel=0.01)
            if dist_opt:
                assert all(r["moments"] == pytest.approx(8 * params / dp, rel=0.01) for r in stage_ranks)


def _moe_rank(rank: int, world_size: int, model_dir: Path) -> list[dict]:
    """Real Megatron ranks of a tiny Qwen3-MoE (bf16, the distributed optimizer) at EP1 x DP2 and EP2 x DP2:
    expert and dense parameter counts and Adam moment bytes of each rank."""
    import torch
    import torch.distributed as dist

    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.config import ActorConfig
    from megatron_gigpo.actor.policy import PolicyActor

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out = []
    for ep in (1, 2):
        config = ActorConfig.build(model_dir, params_dtype="bfloat16", expert_model_parallel_size=ep,
                                   use_distributed_optimizer=True, use_kl_loss=False)
        actor = PolicyActor(config)
        module = actor.model_chunks[0].module
        inner = _step_with_zero_gradients(actor)
        expert = sum(p.numel() for name, p in module.named_parameters() if ".mlp.experts." in name)
        out.append({"ep": ep, "expert": expert, "dense": sum(p.numel() for p in module.parameters()) - expert,
                    "moments": _moment_bytes(inner)})
        del actor
        distributed.destroy()
    return out


def test_moe_parameters_and_expert_optimizer_sharding_match_real_megatron_ranks(tmp_path):
    """EP1 x DP2: every rank holds all experts, and the distributed optimizer halves dense and expert state alike.
    EP2 x DP2: each rank holds half the experts, and their expert-data-parallel group is TP x DP / EP = 1 rank, so
    their Adam state is not sharded at all (the dense state still is, over DP2)."""
    from megatron_gigpo.cluster.memory import rank_parameters

    model_dir = make_tiny_hf_model(tmp_path, "qwen3_moe", tie=False)
    hf = json.loads((model_dir / "config.json").read_text())
    runs = spawn(_moe_rank, 2, model_dir, timeout=900)
    for layout, (ep, expert_dp) in enumerate(((1, 2), (2, 1))):
        expected = rank_parameters(hf, 1, 1, 0, ep=ep, etp=1)
        for r in (runs[0][layout], runs[1][layout]):
            assert (r["ep"], r["dense"], r["expert"]) == (ep, expected.dense, expected.expert), r
            # Adam's two fp32 moments, sharded as the estimate shards them (+ the shards' bucket padding)
            estimate = 8 * (expected.dense // 2 + expected.expert // expert_dp)
            assert r["moments"] == pytest.approx(estimate, rel=0.02), (r, estimate)
