"""LoRA on the Megatron actor (gloo, CPU): zero adapters leave log-probs bit-identical; the same nonzero adapters
give the same log-probs at TP1, TP2 and PP2; only adapters train (gradients, optimizer state), the base stays
bit-identical, TP2 and PP2 take the same adapter step as TP1; the KL reference is the base with the adapters
off; the merged export equals ``W + (alpha / r) B A``.

One spawn of two ranks runs TP1 (DP2), TP2, PP2 and DP2 with the DistributedOptimizer one after the other on a
model with tied embeddings (PP then exercises Megatron's embedding-group gradient sync with a frozen embedding).
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from actor_helpers import actor_config, export_full_weights, make_batch, row_advantages, start_rank
from multiproc import spawn
from tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.multiprocess

LAYOUTS = {"tp1": (1, 1, False), "tp2": (2, 1, False), "pp2": (1, 2, False), "dp2_distopt": (1, 1, True)}
RANK, ALPHA = 4, 8.0


def lora_settings(**overrides):
    from megatron_gigpo.config import LoraConfig

    return dataclasses.replace(LoraConfig(enabled=True, rank=RANK, alpha=ALPHA), **overrides)


def nonzero_adapter(name: str, part: str, shape: tuple[int, int]) -> torch.Tensor:
    """A layout-independent, nonzero adapter matrix of ``shape`` for layer ``name``."""
    seed = int.from_bytes(hashlib.sha256(f"{name}:{part}".encode()).digest()[:4], "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.1


def _layout(model_dir, tp: int, pp: int, distributed_optimizer: bool) -> dict:
    from megatron_gigpo.actor import distributed, lora
    from megatron_gigpo.actor.policy import PolicyActor

    batch, out = make_batch(), {}
    base_config = actor_config(model_dir, tp=tp, pp=pp, use_distributed_optimizer=distributed_optimizer)
    base_config = dataclasses.replace(base_config, optim=dataclasses.replace(base_config.optim, lr=1e-3,
                                                                             adam_eps=1e-3))
    actor = PolicyActor(base_config)
    out["base"] = actor.compute_log_probs(batch)
    out["base_weights"] = export_full_weights(actor)
    del actor
    distributed.destroy()

    actor = PolicyActor(dataclasses.replace(base_config, lora=lora_settings()))
    out["zero_b"] = actor.compute_log_probs(batch)
    actor.set_adapter_weights(nonzero_adapter)
    out["lora"] = actor.compute_log_probs(batch)
    out["reference"] = actor.compute_log_probs(batch, reference=True)
    out["merged"] = export_full_weights(actor)
    out["counts"] = lora.count_parameters(actor.model_chunks)
    opt_params = {id(p) for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
                  for group in opt.optimizer.param_groups for p in group["params"]}
    adapter_params = {id(p) for _, a in lora.lora_adapters(actor.model_chunks) for p in (a.A, a.B)}
    # fp32 on CPU: the optimizer steps the parameters themselves (the DistributedOptimizer: its shards of them)
    out["optimizer_holds_only_adapters"] = opt_params == adapter_params or (
        distributed_optimizer and _distopt_params(actor) <= adapter_params)
    out["num_adapters"] = len(lora.lora_adapters(actor.model_chunks))
    out["update"], _ = actor.update(batch, row_advantages(batch), out["lora"], out["reference"])
    out["frozen_have_no_grad"] = all(p.grad is None and getattr(p, "main_grad", None) is None
                                     for p in actor.model_chunks[0].parameters() if not p.requires_grad)
    out["after_reference"] = actor.compute_log_probs(batch, reference=True)
    out["after_merged"] = export_full_weights(actor)
    out["after_adapters"] = _full_adapters(actor)
    del actor
    distributed.destroy()
    return out


def _distopt_params(actor) -> set[int]:
    """Model parameters behind the DistributedOptimizer's shards."""
    opt = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])[0]
    return {id(p) for group in opt.model_float16_groups + opt.model_fp32_groups for p in group}


def _full_adapters(actor) -> dict[str, torch.Tensor]:
    from megatron_gigpo.actor import lora

    return {k.replace(".lora.", "."): v for k, v in lora.full_adapter_weights(actor.model_chunks).items()}


def _ranks(rank: int, world_size: int, model_dir) -> dict:
    start_rank()
    return {name: _layout(model_dir, *layout) for name, layout in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model_dir = make_tiny_hf_model(tmp_path_factory.mktemp("lora"), tie=True, vocab_size=511)
    return spawn(_ranks, 2, model_dir, timeout=900)


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_zero_b_equals_the_base_exactly(runs):
    for rank in range(2):
        for name in LAYOUTS:
            run = runs[rank][name]
            assert all(x.equal(y) for x, y in zip(run["zero_b"], run["base"])), name
            assert _max_diff(run["lora"], run["base"]) > 1e-3, name  # the nonzero adapters do change the model


def test_tp2_and_pp2_equal_tp1(runs):
    tp1 = runs[0]["tp1"]
    for rank in range(2):
        for name in ("tp2", "pp2", "dp2_distopt"):
            assert _max_diff(runs[rank][name]["lora"], tp1["lora"]) < 1e-4, name


def test_reference_is_the_base_with_adapters_off(runs):
    for rank in range(2):
        for name in LAYOUTS:
            run = runs[rank][name]
            assert all(x.equal(y) for x, y in zip(run["reference"], run["base"])), name
            assert all(x.equal(y) for x, y in zip(run["after_reference"], run["base"])), name  # base frozen


def test_only_adapters_train(runs):
    for name in LAYOUTS:
        run = runs[0][name]
        assert run["optimizer_holds_only_adapters"], name
        assert run["frozen_have_no_grad"], name
        assert 0 < run["counts"]["trainable"] < run["counts"]["total"] / 10, (name, run["counts"])
        # 4 layers x 4 targets, split over the pipeline stages
        assert run["num_adapters"] == (16 if name != "pp2" else 8), name
        assert run["update"]["actor/num_optimizer_steps"] == 1.0
    after = runs[0]["tp1"]["after_adapters"]
    assert all(not after[k].equal(v) for k, v in _initial_adapters(after).items())  # every adapter moved


def _initial_adapters(after: dict) -> dict:
    return {k: nonzero_adapter(k.rsplit(".", 1)[0], k.rsplit(".", 1)[1], tuple(v.shape)) for k, v in after.items()}


def test_layouts_take_the_same_adapter_step(runs):
    tp1 = runs[0]["tp1"]
    for name in ("tp2", "pp2", "dp2_distopt"):
        run = runs[0][name]
        assert run["update"]["actor/loss"] == pytest.approx(tp1["update"]["actor/loss"], abs=1e-5), name
        assert run["update"]["actor/grad_norm"] == pytest.approx(tp1["update"]["actor/grad_norm"], rel=1e-4), name
        assert run["after_adapters"].keys() == tp1["after_adapters"].keys()
        for key, tensor in tp1["after_adapters"].items():
            torch.testing.assert_close(run["after_adapters"][key], tensor, atol=1e-6, rtol=0, msg=(name, key))


def test_merged_export_is_w_plus_scaled_ba(runs):
    """HF-named merged weights: q/k/v and gate/up split like the base, o_proj/down_proj whole; untouched
    tensors (norms, embeddings) equal the base."""
    from tiny_models import tiny_config

    hf = tiny_config(tie=True, vocab_size=511)
    heads, kv, hd = hf.num_attention_heads, hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads
    scale = ALPHA / RANK
    for name in LAYOUTS:
        run = runs[0][name]
        base, merged, adapters = run["base_weights"], run["after_merged"], run["after_adapters"]
        assert merged.keys() == base.keys()
        for layer in range(hf.num_hidden_layers):
            m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
            delta = {t: scale * adapters[f"{m}{t}.B"] @ adapters[f"{m}{t}.A"]
                     for t in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                               "mlp.linear_fc2")}
            qkv = delta["self_attention.linear_qkv"].reshape(kv, (heads // kv + 2) * hd, -1)
            q, k, v = (x.reshape(-1, hf.hidden_size) for x in qkv.split([heads // kv * hd, hd, hd], dim=1))
            gate, up = delta["mlp.linear_fc1"].chunk(2, dim=0)
            expected = {"self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v,
                        "self_attn.o_proj": delta["self_attention.linear_proj"], "mlp.gate_proj": gate,
                        "mlp.up_proj": up, "mlp.down_proj": delta["mlp.linear_fc2"]}
            for proj, d in expected.items():
                key = f"{h}{proj}.weight"
                torch.testing.assert_close(merged[key], base[key] + d, atol=1e-6, rtol=0, msg=(name, key))
        for key in base:
            if not key.endswith(("_proj.weight",)):
                assert merged[key].equal(base[key]), (name, key)


def test_memory_plan_counts_the_adapters_the_actor_builds(runs):
    from tiny_models import tiny_config

    from megatron_gigpo.cluster.memory import lora_rank_parameter_count

    hf = tiny_config(tie=True, vocab_size=511).to_dict()
    for name, (tp, pp, _) in LAYOUTS.items():
        assert runs[0][name]["counts"]["trainable"] == lora_rank_parameter_count(hf, tp, pp, lora_settings()), name
