"""Per-step prompt rendering (one user message, verl-agent's layout) and the truncation policy."""

from __future__ import annotations

import pickle

import pytest

from megatron_gigpo.episodes.prompts import (
    NO_ACTION_TEXT,
    prompt_templates,
    TRUNCATION_MARKER,
    PromptRenderer,
    PromptTemplate,
    PromptTooLongError,
    get_prompt_template,
)

pytestmark = pytest.mark.unit

TASK = "Push every box (X) onto a target (O)."
ACTIONS = ["up", "down", "left", "right"]
# A ChatML template that, like Qwen2.5's, adds a default system message when the list has none.
DEFAULT_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _grid(step: int) -> str:
    # Distinct, multi-line observations so that every step is recognisable in the render.
    return "\n".join(["# # # # #", f"# _ P {step % 10} #", "# X O _ #", "# # # # #"])


def _history(steps: int) -> list[tuple[str, str]]:
    return [(_grid(s), ACTIONS[s % 4]) for s in range(steps)]


def _template_ids(tokenizer, messages) -> list[int]:
    """An independent render: the tokenizer's own tokenizing chat-template call."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


def _entry_marker(template: PromptTemplate, n: int) -> str:
    """The text that opens history entry ``n`` (1-based) in the template's history style."""
    if template.history_style == "observation_action":
        return f"[Step {n}] Observation:\n"
    return f"[Step {n}] Your action:"


@pytest.mark.parametrize("env", sorted(env for env, style in prompt_templates() if style == "verl_agent"))
def test_one_user_message_per_step_rendered_by_the_chat_template(tiny_tokenizer, env):
    template = get_prompt_template(env)
    renderer = PromptRenderer(tiny_tokenizer, template, history_length=3, max_prompt_length=4096)
    for step in range(6):
        history = _history(step)
        prompt = renderer.render(TASK, history, _grid(step), ACTIONS)
        assert not prompt.truncated
        assert prompt.token_ids == _template_ids(tiny_tokenizer, prompt.messages)
        shown = history[-3:] if step else []
        assert prompt.history_pairs_shown == len(shown)
        # No system message of ours and no replayed assistant turns: the history is text in the one message.
        [message] = prompt.messages
        assert message["role"] == "user"
        text = message["content"]
        assert tiny_tokenizer.decode(prompt.token_ids).count(text) == 1
        positions = [text.index(_entry_marker(template, step - len(shown) + i + 1)) for i in range(len(shown))]
        positions.append(text.index(f"You are now at step {step + 1}."))
        assert positions == sorted(positions)
        assert (f"You have already taken {step} step" in text) == (step > 0)
        assert (f"(Steps 1-{step - 3} are not shown.)" in text) == (step > 4)
        # Task first, the output-format instruction last.
        assert text.index(f": {TASK}") < positions[-1] < text.index("<think> </think>")
        assert text.rstrip().endswith(template.instruction)


def test_observation_action_layout(tiny_tokenizer):
    template = get_prompt_template("alfworld")
    renderer = PromptRenderer(tiny_tokenizer, template, history_length=2, max_prompt_length=4096)
    history = [("You are in the middle of a room.", "go to desk 1"), ("On the desk 1, you see a pen.", "")]
    history.append(("Nothing happens.", "take pen 1 from desk 1"))
    prompt = renderer.render("put a pen in the drawer.", history, "You pick up the pen 1.", ["go to drawer 1", "look"])
    text = prompt.messages[0]["content"]
    expected_order = [
        template.preamble,
        "Your task: put a pen in the drawer.",
        "You have already taken 3 steps. The last 2 are shown below,",
        "(Step 1 is not shown.)",
        f"[Step 2] Observation:\nOn the desk 1, you see a pen.\n[Step 2] Your action: {NO_ACTION_TEXT}",
        "[Step 3] Observation:\nNothing happens.\n[Step 3] Your action: take pen 1 from desk 1",
        "You are now at step 4. Current observation:\nYou pick up the pen 1.",
        'Admissible actions for the current step: ["go to drawer 1", "look"]',
        "<think> </think>",
        "<action> </action>",
    ]
    positions = [text.index(part) for part in expected_order]
    assert positions == sorted(positions)
    assert "go to desk 1" not in text and "middle of a room" not in text  # step 1 is outside the window
    first = renderer.render("put a pen in the drawer.", [], "You are in the middle of a room.", ["look"])
    assert "already taken" not in first.messages[0]["content"]
    first_text = first.messages[0]["content"]
    assert "You are now at step 1. Current observation:\nYou are in the middle of a room." in first_text
    no_history = PromptRenderer(tiny_tokenizer, template, history_length=0, max_prompt_length=4096)
    bare = no_history.render("task", history, "obs", None).messages[0]["content"]
    assert "(Steps 1-3 are not shown.)" in bare and "[Step" not in bare and "Admissible" not in bare


def test_search_history_pairs_each_query_with_its_result(tiny_tokenizer):
    template = get_prompt_template("search_qa")
    renderer = PromptRenderer(tiny_tokenizer, template, history_length=4, max_prompt_length=4096)
    question = "Who designed the Analytical Engine?"
    first = renderer.render(question, [], question, None).messages[0]["content"]
    # The question is the first observation: stated once, as the task.
    assert first.count(question) == 1 and "<search> </search>" in first and "<answer> </answer>" in first
    history = [(question, "<search>analytical engine</search>"), ("<information>Doc 1 ...</information>", "")]
    prompt = renderer.render(question, history, "Invalid action. Search or answer.", None)
    text = prompt.messages[0]["content"]
    expected_order = [
        "You have already taken 2 steps. The last 2 are shown below,",
        "[Step 1] Your action: <search>analytical engine</search>\n[Step 1] Result:\n"
        "<information>Doc 1 ...</information>",
        f"[Step 2] Your action: {NO_ACTION_TEXT}\n[Step 2] Result:\nInvalid action. Search or answer.",
        "You are now at step 3.",
    ]
    positions = [text.index(part) for part in expected_order]
    assert positions == sorted(positions) and text.count(question) == 1
    # Without history the newest result is still shown, as the result of the last action.
    bare = PromptRenderer(tiny_tokenizer, template, history_length=0, max_prompt_length=4096)
    text = bare.render(question, history, "<information>Doc 2</information>", None).messages[0]["content"]
    assert "The result of your last action:\n<information>Doc 2</information>" in text and "[Step" not in text


def test_chat_template_adds_its_default_system_text(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = DEFAULT_SYSTEM_TEMPLATE
    renderer = PromptRenderer(tokenizer, get_prompt_template("sokoban"), history_length=2, max_prompt_length=4096)
    prompt = renderer.render(TASK, _history(2), _grid(2), ACTIONS)
    assert [m["role"] for m in prompt.messages] == ["user"]
    text = tokenizer.decode(prompt.token_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n") and text.count("<|im_start|>") == 3


def test_truncation_drops_oldest_history_steps_first(tiny_tokenizer):
    template = get_prompt_template("sokoban")
    full = PromptRenderer(tiny_tokenizer, template, history_length=3, max_prompt_length=4096)
    history = _history(5)
    lengths = [
        len(full.encode_messages(full.build_messages(TASK, history[5 - k :], _grid(5), ACTIONS, 5))) for k in (3, 2, 1)
    ]
    limited = PromptRenderer(tiny_tokenizer, template, history_length=3, max_prompt_length=lengths[1])
    prompt = limited.render(TASK, history, _grid(5), ACTIONS)
    assert (prompt.history_pairs_shown, prompt.history_pairs_dropped, prompt.observation_tokens_dropped) == (2, 1, 0)
    assert prompt.truncated and len(prompt.token_ids) == lengths[1]
    # The newest steps stay: steps 4 and 5 (1-based) are shown, step 3 is gone.
    text = prompt.messages[0]["content"]
    assert "[Step 4] Observation:" in text and "[Step 3]" not in text and "(Steps 1-3 are not shown.)" in text
    assert prompt.token_ids == _template_ids(tiny_tokenizer, prompt.messages)


@pytest.mark.parametrize("env", ["webshop", "search_qa"])
def test_truncation_then_left_truncates_the_observation(tiny_tokenizer, env):
    template = get_prompt_template(env)
    observation = " ".join(f"item{i}" for i in range(400)) + " END-OF-PAGE"
    base = PromptRenderer(tiny_tokenizer, template, history_length=2, max_prompt_length=4096)
    empty = len(base.encode_messages(base.build_messages(TASK, [], TRUNCATION_MARKER, ACTIONS, 2)))
    renderer = PromptRenderer(tiny_tokenizer, template, history_length=2, max_prompt_length=empty + 60)
    prompt = renderer.render(TASK, _history(2), observation, ACTIONS)
    assert prompt.history_pairs_dropped == 2 and prompt.history_pairs_shown == 0
    assert prompt.observation_tokens_dropped > 0
    assert empty < len(prompt.token_ids) <= empty + 60
    current = prompt.messages[0]["content"]
    # The end of the observation is kept, the start is replaced by the marker.
    assert TRUNCATION_MARKER in current and "END-OF-PAGE" in current and "item0 " not in current
    assert prompt.token_ids == _template_ids(tiny_tokenizer, prompt.messages)


def test_prompt_too_long_even_when_fully_truncated_raises(tiny_tokenizer):
    renderer = PromptRenderer(tiny_tokenizer, get_prompt_template("sokoban"), history_length=2, max_prompt_length=50)
    with pytest.raises(PromptTooLongError, match="max_prompt_length=50") as info:
        renderer.render(TASK, _history(2), _grid(2), ACTIONS)
    err = info.value
    # The collector's warning and its prompt_overflow policy read these fields.
    fixed = renderer.build_messages(TASK, [], TRUNCATION_MARKER, ACTIONS, 2)
    assert err.prompt_tokens == len(renderer.encode_messages(fixed)) > 50
    assert (err.max_prompt_length, err.env, err.step, err.num_admissible_actions) == (50, "sokoban", 2, 4)
    again = pickle.loads(pickle.dumps(err))  # crosses process boundaries (Ray) intact
    assert str(again) == str(err) and again.step == 2


def test_bad_arguments_are_named(tiny_tokenizer):
    with pytest.raises(KeyError, match="no prompt template for environment 'chess'"):
        get_prompt_template("chess")
    with pytest.raises(ValueError, match="history_length"):
        PromptRenderer(tiny_tokenizer, get_prompt_template("sokoban"), history_length=-1, max_prompt_length=10)
    with pytest.raises(ValueError, match="max_prompt_length"):
        PromptRenderer(tiny_tokenizer, get_prompt_template("sokoban"), history_length=1, max_prompt_length=0)
    with pytest.raises(ValueError, match="history_style 'turns' is not one of"):
        PromptTemplate(env="x", preamble="p", task_label="t", history_intro="h", instruction="i", history_style="turns")
    renderer = PromptRenderer(tiny_tokenizer, get_prompt_template("sokoban"), history_length=2, max_prompt_length=99)
    with pytest.raises(ValueError, match="history has 2 pairs but the current step index is 1"):
        renderer.build_messages(TASK, _history(2), _grid(1), ACTIONS, 1)
