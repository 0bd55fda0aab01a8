"""The ``model.lora`` recipe section: the LoRA recipes validate, bad values are named, the memory plan counts
adapters only (frozen base, no reference copy) and agrees with the adapters the actor builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gigpo.config import ConfigError, load_config

pytestmark = pytest.mark.unit

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LORA_RECIPES = ["alfworld/qwen2.5-7b-instruct-lora.yaml", "smoke/cpu-lora.yaml"]


@pytest.mark.parametrize("name", LORA_RECIPES)
def test_lora_recipes_validate(name):
    cfg = load_config(RECIPES / name)
    assert cfg.model.lora.enabled and cfg.model.lora.rank >= 1


def test_lora_is_off_by_default():
    assert not load_config(RECIPES / "smoke/cpu.yaml").model.lora.enabled


@pytest.mark.parametrize("override,message", [
    ("model.lora.target_modules=[q_proj]", "model.lora.target_modules[0]='q_proj' is not one of linear_qkv"),
    ("model.lora.target_modules=[]", "must name each adapted layer once"),
    ("model.lora.target_modules=[linear_qkv,linear_qkv]", "must name each adapted layer once"),
    ("model.lora.rank=0", "model.lora.rank=0 must be >= 1"),
    ("model.lora.dropout=1.0", "model.lora.dropout=1.0 must be in [0, 1)"),
    ("model.lora.alpha=0", "model.lora.alpha=0.0 must be > 0"),
    ("model.lora.ranks=4", "ranks"),
])
def test_bad_lora_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config(RECIPES / "smoke/cpu-lora.yaml", [override])


def test_memory_plan_counts_only_adapters():
    from megatron_gigpo.cluster.memory import estimate_memory, lora_rank_parameter_count, policy_hf_config
    from megatron_gigpo.cluster.placement import plan_placement

    full = load_config(RECIPES / "alfworld/qwen2.5-7b-instruct-lora.yaml", ["model.lora.enabled=false",
                                                                              "algorithm.use_kl_loss=true"])
    lora = load_config(RECIPES / "alfworld/qwen2.5-7b-instruct-lora.yaml", ["algorithm.use_kl_loss=true"])
    hf = policy_hf_config(lora)
    rows = {name: estimate_memory(cfg, plan_placement(cfg), hf)[0] for name, cfg in (("full", full), ("lora", lora))}
    adapters = lora_rank_parameter_count(hf, 2, 1, lora.model.lora)
    assert adapters == 28 * 2_998_272  # Qwen2.5-7B, r=64, all four targets, TP2 (worked out by hand)
    assert rows["lora"].reference == 0 < rows["full"].reference
    assert rows["lora"].gradients == adapters * 4
    assert rows["lora"].optimizer_replicated == adapters * 12  # bf16: two fp32 moments + fp32 master copy
    assert rows["lora"].weights == rows["full"].weights + adapters * 2


def test_sft_stage_has_its_own_adapters():
    """``model.lora`` is the RL actor's: the cold start of a LoRA recipe trains every weight unless ``sft.lora``
    says otherwise (a random model with frozen weights and adapters would learn nothing)."""
    from megatron_gigpo.sft.trainer import sft_actor_config

    cfg = load_config(RECIPES / "smoke/cpu-lora.yaml")
    assert cfg.model.lora.enabled and not cfg.sft.lora.enabled
    assert not sft_actor_config(cfg, Path("model"), 10).lora.enabled
    cfg = load_config(RECIPES / "smoke/cpu-lora.yaml", ["sft.lora.enabled=true", "sft.lora.rank=4"])
    assert sft_actor_config(cfg, Path("model"), 10).lora.rank == 4
    with pytest.raises(ConfigError, match="must name each adapted layer once"):
        load_config(RECIPES / "smoke/cpu-lora.yaml", ["sft.lora.enabled=true", "sft.lora.target_modules=[]"])
