"""One configuration (issue 12, part 1): the recipe's sections are the components' settings, passed whole, so
no setting has a second definition or default; every shipped recipe's resolved config.yaml loads back; each
environment's settings, task list and resource check come from its own module through the registry."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_gigpo.config import (
    AlgorithmConfig,
    EnvConfig,
    OptimConfig,
    ParallelConfig,
    RolloutConfig,
    TrainerConfig,
    load_config,
    save_config,
)

pytestmark = pytest.mark.unit

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SHIPPED = sorted(p for p in RECIPES.rglob("*.yaml") if p.name != "base.yaml" and "_base" not in p.parts)


def _names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("recipe", SHIPPED, ids=[str(p.relative_to(RECIPES)) for p in SHIPPED])
def test_every_shipped_recipe_resolves_to_a_loadable_recipe(recipe, tmp_path):
    cfg = load_config(recipe)
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_components_hold_the_recipe_sections_not_copies_of_their_fields():
    """A component's own settings class may add run-time values, never a second definition of a recipe field."""
    from megatron_gigpo.actor.config import ActorConfig
    from megatron_gigpo.rollout.engine import EngineConfig

    actor = _names(ActorConfig)
    for section in (ParallelConfig, OptimConfig, AlgorithmConfig, TrainerConfig):
        assert not actor & _names(section), f"ActorConfig repeats {sorted(actor & _names(section))}"
    assert not _names(EngineConfig) & _names(RolloutConfig)
    assert {f.type for f in dataclasses.fields(ActorConfig)} >= {"ParallelConfig", "OptimConfig", "AlgorithmConfig",
                                                                  "TrainerConfig"}


def test_the_engine_reads_the_rollout_section(tmp_path):
    from megatron_gigpo.rollout.engine import EngineConfig

    (tmp_path / "config.json").write_text("{}")
    rollout = RolloutConfig(prompt_length=100, response_length=28, tensor_parallel_size=2, cpu_kvcache_space_gib=0.5)
    engine = EngineConfig(model_path=str(tmp_path), dtype="float32", rollout=rollout)
    assert engine.max_model_len == 128 and engine.tensor_parallel_size == 2 and engine.rollout is rollout
    with pytest.raises(ValueError, match=r"rollout.top_p=2.0 must be in \(0, 1\]"):
        EngineConfig(model_path=str(tmp_path), dtype="float32", rollout=RolloutConfig(top_p=2.0))


def test_new_recipe_keys_reach_their_components(tmp_path):
    from megatron_gigpo.builders import actor_config
    from megatron_gigpo.cluster.memory import estimate_memory  # noqa: F401 - reads trainer.logprob_chunk_size

    cfg = load_config(RECIPES / "smoke/cpu.yaml", ["trainer.logprob_chunk_size=256", "trainer.shuffle=false",
                                                   "trainer.sequence_packing=true", "algorithm.policy_loss=nll"])
    actor = actor_config(cfg, tmp_path)
    assert (actor.trainer.logprob_chunk_size, actor.trainer.shuffle, actor.trainer.sequence_packing) == (256, False, True)
    assert actor.loss.policy_loss == "nll"


def test_each_environment_registers_its_section():
    from megatron_gigpo.envs.registry import ENVIRONMENTS, env_recipe
    from megatron_gigpo.episodes.templates import prompt_templates

    fields = {f.name: f for f in dataclasses.fields(EnvConfig)}
    for name in ENVIRONMENTS:
        recipe = env_recipe(name)
        assert fields[recipe.section].default_factory is recipe.settings, name
        assert (name, "verl_agent") in prompt_templates(), name
    env = EnvConfig(name="sokoban")
    assert env_recipe("sokoban").check_resources(env) == []
    assert env_recipe("sokoban").env_kwargs(env) == {"dim_room": [6, 6], "num_boxes": 1, "max_steps": 50}


def test_webshop_catalog_files_and_spacy_model_reach_the_environment(tmp_path):
    from megatron_gigpo.envs.registry import check_env_resources, env_kwargs, load_task_list
    from megatron_gigpo.envs.registry import make_env
    from megatron_gigpo.envs.webshop.synthetic import write_synthetic_webshop_data

    data = tmp_path / "webshop"
    write_synthetic_webshop_data(data, num_products=150, seed=3)  # > 500 goals: the val split and a train split
    (data / "items_shuffle_1000.json").rename(data / "my_items.json")
    recipe = RECIPES / "webshop/qwen2.5-1.5b-instruct.yaml"
    cfg = load_config(recipe, [f"env.data_dir={data}", "env.webshop.items_file=my_items.json"])
    assert check_env_resources(cfg.env) == []
    kwargs = env_kwargs(cfg.env)
    assert kwargs["items_file"] == "my_items.json" and kwargs["spacy_model"] is None
    env = make_env("webshop", **kwargs)
    assert env.catalog.files.items_file == "my_items.json" and load_task_list(cfg.env, "val")
    missing = load_config(recipe, [f"env.data_dir={data}"])  # the default file name is gone
    assert any("items_shuffle_1000.json" in p for p in check_env_resources(missing.env))
    no_pipeline = load_config(recipe, [f"env.data_dir={data}", "env.webshop.items_file=my_items.json",
                                       "env.webshop.spacy_model=no_such_spacy_pipeline"])
    assert env_kwargs(no_pipeline.env)["spacy_model"] == "no_such_spacy_pipeline"
    assert any(p.startswith("env.webshop.spacy_model='no_such_spacy_pipeline'")
               for p in check_env_resources(no_pipeline.env))
