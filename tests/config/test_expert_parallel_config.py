"""``parallel.expert_model_parallel_size`` / ``expert_tensor_parallel_size``: megatron-core carves the expert ranks
out of the actor's ranks, so expert TP x EP x PP must divide them; refused when the recipe is read and by the
actor's own config check, naming the keys and numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_gigpo.actor.config import ActorConfig
from megatron_gigpo.config import ConfigError, load_config

pytestmark = pytest.mark.unit

ALF_7B = Path(__file__).resolve().parents[2] / "recipes/alfworld/qwen2.5-7b-instruct.yaml"  # TP4
ALF_30B_A3B = ALF_7B.with_name("qwen3-30b-a3b.yaml")  # EP8


def test_expert_ranks_that_do_not_divide_the_actor_ranks_are_refused():
    cfg = load_config(ALF_7B, [])
    ranks = cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size * \
        cfg.parallel.data_parallel_size
    assert cfg.parallel.expert_model_parallel_size == 1 and cfg.parallel.expert_tensor_parallel == 4  # null: TP
    message = (f"parallel.expert_tensor_parallel_size (1) x expert_model_parallel_size ({ranks + 1}) x "
               f"pipeline_model_parallel_size (1) must divide the actor's {ranks} ranks")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(ALF_7B, ["parallel.expert_tensor_parallel_size=1",
                             f"parallel.expert_model_parallel_size={ranks + 1}"])


def test_actor_config_checks_the_expert_layout_against_the_world():
    config = ActorConfig.build("/m", expert_model_parallel_size=2, moe_aux_loss_coeff=0.01, ppo_mini_batch_size=8)
    config.validate(2)
    assert config.loss.moe_aux_loss_coeff == 0.01
    with pytest.raises(ValueError, match=re.escape("world size 3 is not divisible by expert_tensor_parallel_size 1 "
                                                   "x expert_model_parallel_size 2")):
        config.validate(3)


def test_expert_parallelism_is_accepted_in_recipes():
    """The weight sync and the converters gather experts over the expert-parallel ranks, so a MoE recipe may set EP."""
    cfg = load_config(ALF_30B_A3B, [])
    assert cfg.parallel.expert_model_parallel_size == 8 and cfg.parallel.expert_tensor_parallel == 1
    cfg = load_config(ALF_30B_A3B, ["parallel.expert_model_parallel_size=2"])
    assert cfg.parallel.expert_model_parallel_size == 2


def test_lora_on_a_mixture_of_experts_model_is_refused():
    """actor/lora.py adapts dense linear layers only: a MoE recipe with LoRA is refused before any process starts,
    naming the key."""
    with pytest.raises(ConfigError, match=re.escape("model.lora.enabled=true with a mixture-of-experts model")):
        load_config(ALF_30B_A3B, ["model.lora.enabled=true"])
