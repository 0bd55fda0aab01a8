"""Recipe config: strict keys, base chains, overrides, cross-field checks, every shipped recipe."""

import re
from pathlib import Path

import pytest
import yaml

from megatron_gigpo.config import ConfigError, load_config, parse_overrides, save_config

pytestmark = pytest.mark.unit

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _is_base(path: Path) -> bool:
    return path.name == "base.yaml" or "_base" in path.parts


def all_recipes() -> list[Path]:
    return sorted(p for p in RECIPES.rglob("*.yaml") if not _is_base(p))


def test_every_recipe_is_found():
    names = {str(p.relative_to(RECIPES)) for p in all_recipes()}
    for expected in (
        "alfworld/qwen2.5-1.5b-instruct.yaml", "alfworld/qwen2.5-7b-instruct.yaml",
        "webshop/qwen2.5-1.5b-instruct.yaml", "webshop/qwen2.5-7b-instruct.yaml",
        "search_qa/qwen2.5-3b-instruct.yaml", "search_qa/qwen2.5-7b-instruct.yaml",
        "sokoban/qwen2.5-1.5b-instruct.yaml", "smoke/cpu.yaml", "smoke/alfworld-cpu.yaml",
    ):
        assert expected in names


def test_every_base_is_used():
    bases = {p.resolve() for p in RECIPES.rglob("*.yaml") if _is_base(p)}
    used = set()
    for p in RECIPES.rglob("*.yaml"):
        data = yaml.safe_load(p.read_text()) or {}
        if "base" in data:
            used.add((p.parent / data["base"]).resolve())
    assert bases <= used, f"unused base recipes: {bases - used}"


@pytest.mark.parametrize("recipe", all_recipes(), ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_validates(recipe):
    cfg = load_config(recipe)
    p, t = cfg.parallel, cfg.trainer
    assert p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.data_parallel_size == (
        t.nnodes * t.devices_per_node
    )


def test_released_settings():
    alf = load_config(RECIPES / "alfworld/qwen2.5-1.5b-instruct.yaml")
    assert (alf.env.num_groups, alf.rollout.n, alf.env.max_steps) == (16, 8, 50)
    assert (alf.rollout.prompt_length, alf.rollout.response_length, alf.optim.lr) == (2048, 512, 1e-6)
    assert (alf.algorithm.kl_loss_type, alf.algorithm.kl_loss_coef, alf.algorithm.gamma) == ("low_var_kl", 0.01, 0.95)
    assert (alf.algorithm.step_advantage_w, alf.algorithm.mode, alf.algorithm.invalid_action_penalty_coef) == (
        1.0, "mean_std_norm", 0.1)
    assert alf.env.history_length == 2
    web = load_config(RECIPES / "webshop/qwen2.5-1.5b-instruct.yaml")
    assert (web.env.max_steps, web.rollout.prompt_length, web.algorithm.mode) == (15, 4096, "mean_norm")
    s = load_config(RECIPES / "search_qa/qwen2.5-3b-instruct.yaml")
    assert (s.env.num_groups, s.rollout.n, s.env.max_steps, s.env.history_length) == (256, 5, 4, 4)
    assert (s.algorithm.kl_loss_coef, s.algorithm.invalid_action_penalty_coef) == (0.001, 0.01)
    assert (s.algorithm.enable_similarity, s.algorithm.similarity_thresh, s.algorithm.entropy_coeff) == (True, 0.9, 0.0)


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _minimal(**extra):
    data = {"model": {"path": "Qwen/Qwen2.5-1.5B-Instruct"}, "env": {"name": "sokoban"},
            "trainer": {"devices_per_node": 1}}
    for k, v in extra.items():
        data.setdefault(k, {}).update(v)
    return data


def test_unknown_key_names_file_key_and_suggestion(tmp_path):
    path = _write(tmp_path, "r.yaml", _minimal(algorithm={"gama": 0.9}))
    with pytest.raises(ConfigError, match=r"r\.yaml: unknown key 'algorithm\.gama'; did you mean 'algorithm\.gamma'"):
        load_config(path)
    path = _write(tmp_path, "s.yaml", _minimal(rollotu={"n": 2}))
    with pytest.raises(ConfigError, match=r"unknown key 'rollotu'; did you mean 'rollout'"):
        load_config(path)


def test_unknown_key_in_base_names_the_base_file(tmp_path):
    _write(tmp_path, "b.yaml", {"env": {"sokoban": {"num_boxs": 2}}})
    top = _write(tmp_path, "top.yaml", {"base": "b.yaml", **_minimal()})
    with pytest.raises(ConfigError, match=r"b\.yaml: unknown key 'env\.sokoban\.num_boxs'; did you mean 'env\.sokoban\.num_boxes'"):
        load_config(top)


def test_base_chain_and_overrides(tmp_path):
    _write(tmp_path, "b.yaml", _minimal(env={"max_steps": 7}, rollout={"n": 4}))
    top = _write(tmp_path, "top.yaml", {"base": "b.yaml", "rollout": {"n": 6}})
    cfg = load_config(top, ["env.max_steps=9", "rollout.stop=['</action>']", "optim.lr=3e-6"])
    assert (cfg.env.max_steps, cfg.rollout.n, cfg.rollout.stop, cfg.optim.lr) == (9, 6, ["</action>"], 3e-6)
    assert cfg.env.name == "sokoban"


def test_override_errors(tmp_path):
    path = _write(tmp_path, "r.yaml", _minimal())
    with pytest.raises(ConfigError, match="command line: unknown key 'env.max_step'; did you mean 'env.max_steps'"):
        load_config(path, ["env.max_step=3"])
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["max_steps"])
    with pytest.raises(ConfigError, match=r"env\.max_steps: expected int, got 'many'"):
        load_config(path, ["env.max_steps=many"])


def test_missing_required_and_missing_file(tmp_path):
    path = _write(tmp_path, "r.yaml", {"env": {"name": "sokoban"}})
    with pytest.raises(ConfigError, match="missing required key 'model.path'"):
        load_config(path)
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_config(tmp_path / "nope.yaml")
    _write(tmp_path, "loop.yaml", {"base": "loop.yaml"})
    with pytest.raises(ConfigError, match="circular"):
        load_config(tmp_path / "loop.yaml")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"parallel": {"tensor_model_parallel_size": 2}}, r"TP\(2\) x PP\(1\) x DP\(1\) = 2 != world size 1"),
        ({"model": {"path": "builtin:smollm2-135m-instruct"}, "parallel": {"tensor_model_parallel_size": 2},
          "trainer": {"devices_per_node": 2}}, r"must divide the model's attention heads \(9\) and KV heads \(3\)"),
        ({"model": {"path": "Qwen/Qwen2.5-7B-Instruct"}, "parallel": {"tensor_model_parallel_size": 8},
          "trainer": {"devices_per_node": 8}}, r"KV heads \(4\)"),
        ({"parallel": {"pipeline_model_parallel_size": 3}, "trainer": {"devices_per_node": 3}},
         r"must divide the model's 28 layers"),
        ({"rollout": {"n": 1}}, r"rollout.n=1: group-relative estimator 'gigpo' needs a group size >= 2"),
        ({"algorithm": {"gamma": 0.0}}, r"algorithm.gamma=0.0 must be in \(0, 1\]"),
        ({"algorithm": {"similarity_thresh": 1.0}}, r"algorithm.similarity_thresh=1.0 must be in \(0, 1\)"),
        ({"algorithm": {"adv_estimator": "gigpoo"}}, r"algorithm.adv_estimator='gigpoo' is not one of"),
        ({"algorithm": {"mode": "std"}}, r"algorithm.mode='std' is not one of mean_norm, mean_std_norm"),
        ({"parallel": {"data_parallel_size": 2}, "trainer": {"devices_per_node": 2, "ppo_mini_batch_size": 3}},
         r"ppo_mini_batch_size=3 must be divisible by DP=2"),
        ({"model": {"path": "/nowhere/model"}}, r"model.path '/nowhere/model': no config.json there"),
        ({"rollout": {"prompt_overflow": "truncate"}},
         r"rollout.prompt_overflow='truncate' is not one of end_episode, error"),
        # The cold start writes expert demonstrations when sft.train_file is null: refused where there is no expert.
        ({"env": {"name": "webshop"}, "sft": {"enabled": True}},
         r"sft.enabled=true with sft.train_file null needs expert demonstrations, but env.name='webshop': no expert "
         r"policy for demonstrations; experts exist for alfworld, sokoban; set sft.train_file"),
        # vLLM refuses a max_model_len beyond the model's positions when the engine starts: refuse it here.
        ({"rollout": {"prompt_length": 32768, "response_length": 1}, "trainer": {"micro_batch_tokens": 40000}},
         r"rollout.prompt_length \+ rollout.response_length = 32769 tokens exceeds the max_position_embeddings=32768 "
         r"of model.path 'Qwen/Qwen2.5-1.5B-Instruct'"),
        ({"model": {"path": "builtin:smollm2-135m-instruct"}, "rollout": {"prompt_length": 8000},
          "trainer": {"micro_batch_tokens": 9000}}, r"= 8512 tokens exceeds the max_position_embeddings=8192"),
        ({"trainer": {"micro_batch_tokens": 100}}, r"trainer.micro_batch_tokens=100 is smaller than one row"),
        ({"trainer": {"log_prob_micro_batch_tokens": 100}},
         r"trainer.log_prob_micro_batch_tokens=100 is smaller than one row \(rollout.prompt_length \+ "
         r"rollout.response_length = \d+\)"),
    ],
)
def test_cross_field_checks(tmp_path, extra, message):
    path = _write(tmp_path, "r.yaml", _minimal(**extra))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_prompt_overflow_policy(tmp_path):
    # Every benchmark recipe inherits the explicit default of _base/gigpo.yaml.
    assert yaml.safe_load((RECIPES / "_base/gigpo.yaml").read_text())["rollout"]["prompt_overflow"] == "end_episode"
    assert {load_config(p).rollout.prompt_overflow for p in all_recipes()} == {"end_episode"}
    path = _write(tmp_path, "r.yaml", _minimal())
    assert load_config(path, ["rollout.prompt_overflow=error"]).rollout.prompt_overflow == "error"
    with pytest.raises(ConfigError, match=r"command line: unknown key 'rollout\.prompt_overflw'; did you mean "
                                          r"'rollout\.prompt_overflow'"):
        load_config(path, ["rollout.prompt_overflw=error"])


def test_local_model_dir_is_read(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"num_attention_heads": 6, "num_key_value_heads": 3, "num_hidden_layers": 4}')
    path = _write(tmp_path, "r.yaml", _minimal(model={"path": str(model)}, parallel={"tensor_model_parallel_size": 2},
                                               trainer={"devices_per_node": 2}))
    with pytest.raises(ConfigError, match=r"attention heads \(6\) and KV heads \(3\)"):
        load_config(path)
    # The context limit is read from the same config.json: 2048 + 512 tokens do not fit 2048 positions.
    (model / "config.json").write_text('{"num_attention_heads": 6, "num_key_value_heads": 3, "num_hidden_layers": 4, '
                                       '"max_position_embeddings": 2048}')
    with pytest.raises(ConfigError, match=r"= 2560 tokens exceeds the max_position_embeddings=2048"):
        load_config(path, ["rollout.prompt_length=2048", "rollout.response_length=512"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(RECIPES / "smoke/cpu.yaml")
    out = tmp_path / "run" / "config.yaml"
    save_config(cfg, out)
    again = load_config(out)
    assert again == cfg
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".tmp")]


def test_webshop_human_goals_key_reaches_the_environment(tmp_path):
    from megatron_gigpo.envs.registry import env_kwargs, load_task_list
    from megatron_gigpo.envs.registry import make_env
    from megatron_gigpo.envs.webshop.synthetic import write_synthetic_webshop_data

    # The WebShop base recipe states verl-agent's default explicitly: synthetic goals.
    assert yaml.safe_load((RECIPES / "webshop/base.yaml").read_text())["env"]["webshop"]["human_goals"] is False
    assert {load_config(RECIPES / f"webshop/{m}.yaml").env.webshop.human_goals
            for m in ("qwen2.5-1.5b-instruct", "qwen2.5-7b-instruct")} == {False}
    data = tmp_path / "webshop"
    write_synthetic_webshop_data(data, num_products=8, seed=3)
    path = _write(tmp_path, "r.yaml", _minimal(env={"name": "webshop", "data_dir": str(data)}))
    goals = {}
    for human in (False, True):
        cfg = load_config(path, [f"env.webshop.human_goals={str(human).lower()}"])
        assert cfg.env.webshop.human_goals is human
        kwargs = env_kwargs(cfg.env)
        assert kwargs["human_goals"] is human
        tasks = load_task_list(cfg.env, "val")
        env = make_env("webshop", **kwargs)
        assert env.catalog.files.human_goals is human
        reset = env.reset(tasks[0], seed=0)
        assert reset.task_description == tasks[0].payload["goal"]["instruction_text"]
        goals[human] = [t.payload["goal"]["instruction_text"] for t in tasks]
    # The generated data phrases human goals "i am looking for ..." and synthetic ones "i want a ...".
    assert all(g.startswith("i want a") for g in goals[False])
    assert all(g.startswith("i am looking for") for g in goals[True])
    with pytest.raises(ConfigError, match=r"env\.webshop\.human_goals: expected bool, got 'sometimes'"):
        load_config(path, ["env.webshop.human_goals=sometimes"])


def test_duplicate_keys_and_bad_values_are_errors(tmp_path):
    recipe = tmp_path / "dup.yaml"
    recipe.write_text(f"base: {RECIPES / 'smoke/cpu.yaml'}\noptim:\n  lr: 1.0e-6\n  lr: 2.0e-6\n")
    with pytest.raises(ConfigError, match="'lr' appears twice"):
        load_config(recipe)
    smoke = RECIPES / "smoke/cpu.yaml"
    for override, message in (("optim.lr=-1", "optim.lr=-1"), ("trainer.experiment_name=", "experiment_name"),
                              ("trainer.experiment_name=a/b", "plain, non-empty folder name"),
                              # YAML 1.1 turns `on` into true: say so instead of a bare type error
                              ("logging.wandb_mode=on", "logging.wandb_mode: expected str, got True (YAML reads on, "
                                                        "off, yes and no as true or false: quote the word)")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(smoke, [override])


def test_saved_config_is_world_readable(tmp_path):
    save_config(load_config(RECIPES / "smoke/cpu.yaml"), tmp_path / "config.yaml")
    assert (tmp_path / "config.yaml").stat().st_mode & 0o777 == 0o644


def test_search_information_format_reaches_the_environment(tmp_path, shared_dir):
    from megatron_gigpo.config import field_choices, recipe_fields
    from megatron_gigpo.envs.registry import env_kwargs
    from megatron_gigpo.envs.search_qa.passages import INFORMATION_FORMATS

    fields = {key: f for key, f, _ in recipe_fields()}
    assert field_choices(fields["env.search.information_format"]) == INFORMATION_FORMATS
    # The search recipes follow verl-agent (the paper's code); the environment's own default is Search-R1's.
    assert load_config(RECIPES / "search_qa/qwen2.5-3b-instruct.yaml").env.search.information_format == "verl_agent"
    wiki = shared_dir / "data" / "search_qa" / "wiki18_sample_1000.jsonl"
    search = {"retriever": "bm25", "passages_path": str(wiki)}
    path = _write(tmp_path, "r.yaml", _minimal(env={"name": "search_qa", "search": search}))
    assert env_kwargs(load_config(path).env)["information_format"] == "search_r1"
    cfg = load_config(path, ["env.search.information_format=verl_agent"])
    assert env_kwargs(cfg.env)["information_format"] == "verl_agent"
    with pytest.raises(ConfigError, match="information_format"):
        load_config(path, ["env.search.information_format=xml"])


def test_group_relative_estimators_are_read_from_the_registry():
    """``rollout.n >= 2`` and dynamic sampling are asked of exactly the estimators registered as group-relative:
    an estimator registered with ``group_relative=False`` validates with one rollout per task and cannot drive
    dynamic sampling; the registry's names are the choices of ``algorithm.adv_estimator``."""
    from megatron_gigpo.algo.advantages import (
        ADVANTAGE_ESTIMATORS,
        GROUP_RELATIVE_ESTIMATORS,
        register_advantage_estimator,
    )
    from megatron_gigpo.config import group_relative_estimators

    assert group_relative_estimators() == ("gigpo", "grpo", "rloo")
    recipe = RECIPES / "smoke/cpu.yaml"
    with pytest.raises(ConfigError, match="group-relative estimator 'grpo' needs a group size >= 2"):
        load_config(recipe, ["algorithm.adv_estimator=grpo", "rollout.n=1"])
    register_advantage_estimator("baseline_only", group_relative=False)(lambda inputs, params: None)
    register_advantage_estimator("my_grpo")(lambda inputs, params: None)  # group-relative by default
    try:
        with pytest.raises(ConfigError, match="group-relative estimator 'my_grpo' needs a group size >= 2"):
            load_config(recipe, ["algorithm.adv_estimator=my_grpo", "rollout.n=1"])
        assert "baseline_only" not in group_relative_estimators()
        cfg = load_config(recipe, ["algorithm.adv_estimator=baseline_only", "rollout.n=1"])
        assert cfg.algorithm.adv_estimator == "baseline_only"
        with pytest.raises(ConfigError, match=r"needs a group-relative estimator \(gigpo, grpo, rloo, my_grpo\), got "
                                              r"algorithm.adv_estimator='baseline_only'"):
            load_config(recipe, ["algorithm.adv_estimator=baseline_only", "algorithm.dynamic_sampling.enabled=true"])
    finally:
        del ADVANTAGE_ESTIMATORS["baseline_only"], ADVANTAGE_ESTIMATORS["my_grpo"]
        GROUP_RELATIVE_ESTIMATORS.remove("my_grpo")
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='baseline_only' is not one of gigpo, grpo, rloo"):
        load_config(recipe, ["algorithm.adv_estimator=baseline_only"])


def test_the_params_dtype_rule_is_stated_once():
    """float32 on CPU whatever ``model.dtype`` says, ``model.dtype`` on CUDA: the actor, the engines and the memory
    plan all read :meth:`ModelConfig.params_dtype`."""
    from megatron_gigpo.builders import actor_config

    cfg = load_config(RECIPES / "smoke/cpu.yaml", ["model.dtype=bfloat16"])
    assert cfg.model.params_dtype("cpu") == "float32" and cfg.model.params_dtype("cuda") == "bfloat16"
    assert actor_config(cfg, "/nonexistent").params_dtype == "float32"


SEVEN_B = RECIPES / "alfworld/qwen2.5-7b-instruct.yaml"  # parallel.data_parallel_size and rollout.num_engines: auto


@pytest.mark.parametrize("overrides, dp, engines", [
    ([], 2, 4),  # the recipe's 1 x 8 GPUs, TP4, engines at TP2
    (["trainer.nnodes=2"], 4, 8),  # slurm/README.md's two nodes
    (["trainer.devices_per_node=4"], 1, 2),
    (["trainer.device=cpu", "trainer.devices_per_node=4", "parallel.tensor_model_parallel_size=1"], 4, 2),
    (["rollout.weight_sync_mode=disaggregated", "rollout.num_engines=2"], 1, 2),  # the actor takes the 4 left
    (["rollout.weight_sync_mode=disaggregated", "parallel.data_parallel_size=1"], 1, 2),  # the engines do
    (["parallel.data_parallel_size=null", "rollout.num_engines=null"], 2, 4),  # null is auto too
    (["parallel.data_parallel_size=1", "trainer.devices_per_node=4", "rollout.num_engines=1"], 1, 1),  # as written
])
def test_auto_sizes_follow_the_world_size(tmp_path, overrides, dp, engines):
    cfg = load_config(SEVEN_B, overrides)
    assert (cfg.parallel.data_parallel_size, cfg.rollout.num_engines) == (dp, engines)
    save_config(cfg, tmp_path / "config.yaml")  # a run's resolved recipe holds the numbers
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert (saved["parallel"]["data_parallel_size"], saved["rollout"]["num_engines"]) == (dp, engines)


@pytest.mark.parametrize("overrides, message", [
    # a number is checked as written, with the way out
    (["trainer.nnodes=2", "parallel.data_parallel_size=2"],
     "TP(4) x PP(1) x DP(2) = 8 != world size 16 (trainer.nnodes=2 x trainer.devices_per_node=8); "
     "parallel.data_parallel_size: auto derives DP from the world size"),
    (["parallel.tensor_model_parallel_size=3"], "parallel.data_parallel_size=auto needs TP(3) x PP(1) = 3 to divide "
                                                "the world size 8 (trainer.nnodes=1 x trainer.devices_per_node=8)"),
    (["rollout.tensor_parallel_size=3"], "rollout.num_engines=auto needs rollout.tensor_parallel_size=3 to divide "
                                         "the 8 devices (trainer.nnodes=1 x trainer.devices_per_node=8)"),
    (["rollout.weight_sync_mode=disaggregated"], "parallel.data_parallel_size and rollout.num_engines are both auto "
                                                 "with rollout.weight_sync_mode=disaggregated: set one of them"),
    (["rollout.weight_sync_mode=disaggregated", "rollout.num_engines=3"],
     "parallel.data_parallel_size=auto needs TP(4) x PP(1) = 4 to divide the 2 GPUs left of 8"),
    (["parallel.data_parallel_size=some"], "parallel.data_parallel_size: expected a whole number or auto, got 'some'"),
    (["rollout.num_engines=0"], "rollout.num_engines=0 must be >= 1"),
])
def test_auto_sizes_that_do_not_divide_are_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(SEVEN_B, overrides)
    assert message in str(err.value)


def test_a_recipe_still_auto_is_not_validated():
    import dataclasses

    from megatron_gigpo.config import validate_config

    cfg = load_config(SEVEN_B)
    with pytest.raises(ConfigError, match="rollout.num_engines still auto: load the recipe with load_config"):
        validate_config(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_engines=None)))
