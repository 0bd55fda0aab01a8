"""``actor.recompute_*`` and ``parallel.sequence_parallel``: megatron-core 0.16's rules on them (and the actor's:
no sequence parallelism with LoRA adapters) refused when the recipe is read, naming the keys, before anything
starts; the actor's own config check says the same."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_gigpo.actor.config import ActorConfig
from megatron_gigpo.config import ConfigError, load_config

pytestmark = pytest.mark.unit

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
ALF_7B = RECIPES / "alfworld/qwen2.5-7b-instruct.yaml"  # TP4, 28 layers
SMOKE = RECIPES / "smoke/cpu.yaml"  # TP1 x PP2
FULL = ["actor.recompute_granularity=full", "actor.recompute_method=block", "actor.recompute_num_layers=28"]


@pytest.mark.parametrize("recipe, overrides", [
    (ALF_7B, FULL),
    (ALF_7B, ["actor.recompute_granularity=selective", "parallel.sequence_parallel=true"]),
    (ALF_7B, ["actor.recompute_granularity=full", "actor.recompute_method=uniform", "actor.recompute_num_layers=1"]),
    (SMOKE, ["actor.recompute_granularity=full", "actor.recompute_method=uniform", "actor.recompute_num_layers=15"]),
])
def test_valid_settings_are_read(recipe, overrides):
    cfg = load_config(recipe, overrides)
    settings = dict(o.split("=") for o in overrides)
    assert cfg.actor.recompute_granularity == settings["actor.recompute_granularity"]
    assert cfg.parallel.sequence_parallel == ("parallel.sequence_parallel" in settings)


@pytest.mark.parametrize("recipe, overrides, message", [
    (SMOKE, ["parallel.sequence_parallel=true"],
     "parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1 (got 1)"),
    (ALF_7B, ["parallel.sequence_parallel=true", "model.lora.enabled=true"],
     "parallel.sequence_parallel=true is not supported with model.lora.enabled=true (LoRA adapters)"),
    (ALF_7B, ["parallel.sequence_parallel=true", "sft.lora.enabled=true"],
     "parallel.sequence_parallel=true is not supported with sft.lora.enabled=true"),
    (ALF_7B, ["actor.recompute_granularity=full", "actor.recompute_num_layers=1"],
     "actor.recompute_granularity=full needs actor.recompute_method (uniform or block)"),
    (ALF_7B, ["actor.recompute_granularity=full", "actor.recompute_method=uniform"],
     "actor.recompute_granularity=full needs actor.recompute_num_layers"),
    (ALF_7B, FULL[:2] + ["actor.recompute_num_layers=29"],
     "actor.recompute_num_layers=29 must be at most the 28 layers of a pipeline stage"),
    (SMOKE, FULL[:2] + ["actor.recompute_num_layers=16"],
     "actor.recompute_num_layers=16 must be at most the 15 layers of a pipeline stage"),
    (ALF_7B, ["actor.recompute_granularity=selective", "actor.recompute_num_layers=2"],
     "actor.recompute_num_layers=2 is only read with actor.recompute_granularity=full (got 'selective')"),
    (ALF_7B, ["actor.recompute_method=uniform"],
     "actor.recompute_method='uniform' is only read with actor.recompute_granularity=full (got None)"),
    (ALF_7B, ["actor.recompute_granularity=partial"],
     "actor.recompute_granularity='partial' is not one of selective, full"),
    (ALF_7B, ["actor.recompute_method=blocks"], "actor.recompute_method='blocks' is not one of uniform, block"),
])
def test_invalid_settings_are_refused_naming_the_keys(recipe, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(recipe, overrides)


def test_the_actor_config_checks_the_same_rules(tmp_path):
    with pytest.raises(ValueError, match=re.escape("parallel.sequence_parallel=true needs parallel.tensor_model_")):
        ActorConfig.build(tmp_path, sequence_parallel=True).validate()
    with pytest.raises(ValueError, match=re.escape("recompute.recompute_granularity=full needs "
                                                   "recompute.recompute_method")):
        ActorConfig.build(tmp_path, recompute_granularity="full", recompute_num_layers=1).validate()
    config = ActorConfig.build(tmp_path, tensor_model_parallel_size=2, sequence_parallel=True,
                               recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config.validate()
    assert config.transformer_overrides() == {"sequence_parallel": True, "recompute_granularity": "full",
                                              "recompute_method": "uniform", "recompute_num_layers": 1}
    assert config.sequence_multiple == 2 and ActorConfig.build(tmp_path).sequence_multiple == 1


def test_the_run_actor_gets_the_recipes_settings():
    from megatron_gigpo.builders import actor_config

    cfg = load_config(ALF_7B, ["actor.recompute_granularity=selective", "parallel.sequence_parallel=true"])
    actor = actor_config(cfg, "/models/x")
    assert actor.recompute is cfg.actor and actor.parallel.sequence_parallel
    assert actor.transformer_overrides()["recompute_granularity"] == "selective"
