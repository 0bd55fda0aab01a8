"""The wording of the per-step prompts: templates keyed by (environment, style), each declared by its
environment's module (``RECIPE.templates``, :mod:`megatron_gigpo.envs.recipe`) and collected here.

A template (:class:`PromptTemplate`) holds an environment's own text (preamble, task label, reply instruction);
its :class:`PromptLayout` holds the connecting phrases the renderer (:mod:`megatron_gigpo.episodes.prompts`)
puts between them (progress note, history entries, current step, admissible-action line). Styles, the values
of the recipe key ``env.prompt_template`` (:data:`PROMPT_STYLES`):

- ``verl_agent`` (default): the GiGPO paper's prompts, laid out as verl-agent writes them
  (``agent_system/environments/prompts/{sokoban,alfworld,webshop,search}.py``): role and rules, a numbered
  history with a progress note, a step-by-step reasoning instruction (~370 SmolLM2 tokens at Sokoban step 1).
- ``compact``: the same structure and the same reply format (``<think>...</think>`` then ``<action>...</action>``,
  or ``<search>``/``<answer>`` for search QA, which the projections require), with a one-line preamble, terse
  history labels and a one-line instruction (~120 tokens at Sokoban step 1): a speed lever for CPU recipes
  and tiny models cold-started by supervised fine-tuning. Sokoban's compact template does not list the four
  admissible moves (its instruction names them).
- ``minimal`` (Sokoban only): the compact layout without any fixed text: an empty system message instead of
  the chat template's default one, no preamble, task line or instruction; only the shown history and the
  current grid (60 tokens at a 6x6 room's step 1 and 113 with one history step, against 165 and 218 with
  ``compact``, for the CPU main job's SmolLM2 tokenizer cut to 4,096 ids). For a model trained from random
  weights on demonstrations, which cannot read instructions and for which text that never changes is only
  compute; the reply format is unchanged (the environment's projection still requires it, and the
  demonstrations teach it). A pretrained model needs the other styles.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

#: How a template writes past steps: ``observation_action`` (the observation the agent saw, then the action
#: it took) or ``action_result`` (the action, then what it returned; the newest result is the current
#: observation).
HISTORY_STYLES: tuple[str, ...] = ("observation_action", "action_result")
#: Values of ``env.prompt_template`` (module docstring); the first is the default.
PROMPT_STYLES: tuple[str, ...] = ("verl_agent", "compact", "minimal")
DEFAULT_PROMPT_STYLE = PROMPT_STYLES[0]
#: History text of a step whose response had no usable action (the environment got an empty action).
NO_ACTION_TEXT = "(no valid action)"


@dataclass(frozen=True)
class PromptLayout:
    """The connecting phrases of one style, as ``str.format`` patterns (an empty pattern writes nothing).

    Attributes:
        style: the style name (:data:`PROMPT_STYLES`).
        taken: progress note from step 2 on; fields ``{step}`` (steps taken) and ``{s}`` (plural suffix).
        shown_one / shown_many: appended to the note when one / several past steps are shown; ``{shown}``,
            ``{intro}`` (the template's ``history_intro``).
        hidden_one / hidden_many: appended when step 1 / steps ``1..{last}`` fall outside the window.
        observation_action_entry: one past step in the ``observation_action`` history style; ``{n}``
            (1-based step), ``{observation}``, ``{action}``.
        action_result_entry: one past step in the ``action_result`` style; ``{n}``, ``{action}``, ``{result}``.
        current_observation: the current step with its observation; ``{step}`` (1-based), ``{observation}``.
        current_result: the current step with the newest result (``action_result`` style, no history shown).
        current_bare: the current step alone (its observation is the task, or the last history entry).
        admissible: the admissible-action line; ``{actions}`` (quoted, comma-separated).
    """

    style: str
    taken: str
    shown_one: str
    shown_many: str
    hidden_one: str
    hidden_many: str
    observation_action_entry: str
    action_result_entry: str
    current_observation: str
    current_result: str
    current_bare: str
    admissible: str


VERL_AGENT_LAYOUT = PromptLayout(
    style="verl_agent",
    taken="You have already taken {step} step{s}.",
    shown_one=" The last one is shown below, {intro}.",
    shown_many=" The last {shown} are shown below, {intro}.",
    hidden_one=" (Step 1 is not shown.)",
    hidden_many=" (Steps 1-{last} are not shown.)",
    observation_action_entry="[Step {n}] Observation:\n{observation}\n[Step {n}] Your action: {action}",
    action_result_entry="[Step {n}] Your action: {action}\n[Step {n}] Result:\n{result}",
    current_observation="You are now at step {step}. Current observation:\n{observation}",
    current_result="You are now at step {step}. The result of your last action:\n{observation}",
    current_bare="You are now at step {step}.",
    admissible="Admissible actions for the current step: [{actions}]",
)

# Terse: the step numbers of the entries say what the progress note would (so it is left out).
COMPACT_LAYOUT = PromptLayout(
    style="compact",
    taken="",
    shown_one="",
    shown_many="",
    hidden_one="",
    hidden_many="",
    observation_action_entry="Step {n}:\n{observation}\nAction: {action}",
    action_result_entry="Step {n} action: {action}\nResult:\n{result}",
    current_observation="Now:\n{observation}",
    current_result="Now, last result:\n{observation}",
    current_bare="",
    admissible="Actions: [{actions}]",
)

# The compact phrases; templates of this style carry no fixed text of their own (module docstring).
MINIMAL_LAYOUT = dataclasses.replace(COMPACT_LAYOUT, style="minimal")


@dataclass(frozen=True)
class PromptTemplate:
    """The environment-specific wording of the per-step user message (layout in :mod:`.prompts`).

    Attributes:
        env: environment name the template belongs to.
        preamble: opening paragraph: who the agent is and the environment's rules.
        task_label: how the task line starts (``"<task_label>: <task description>"``); empty: no task line.
        history_intro: phrase introducing the shown past steps (what each entry holds); used by layouts
            whose ``shown_*`` patterns name it.
        instruction: closing paragraph: the reasoning and output-format instruction.
        history_style: one of :data:`HISTORY_STYLES`.
        show_initial_observation: False when the step-1 observation is the task itself (search QA's
            question), so it is not repeated.
        layout: the connecting phrases (:class:`PromptLayout`); its ``style`` is the template's style.
        list_admissible: write the admissible-action line when the environment gives a list.
        system: a system message sent before the user message; None (default): none, so the tokenizer's
            chat template adds its default system text (Qwen2.5's, SmolLM2's); ``""`` an empty one.

    Raises:
        ValueError: an unknown ``history_style`` or layout style.
    """

    env: str
    preamble: str
    task_label: str
    history_intro: str
    instruction: str
    history_style: str = "observation_action"
    show_initial_observation: bool = True
    layout: PromptLayout = VERL_AGENT_LAYOUT
    list_admissible: bool = True
    system: str | None = None

    def __post_init__(self) -> None:
        if self.history_style not in HISTORY_STYLES:
            raise ValueError(
                f"PromptTemplate {self.env!r}: history_style {self.history_style!r} is not one of {HISTORY_STYLES}"
            )
        if self.layout.style not in PROMPT_STYLES:
            raise ValueError(f"PromptTemplate {self.env!r}: layout style {self.layout.style!r} not in {PROMPT_STYLES}")

    @property
    def style(self) -> str:
        return self.layout.style

    def format_action(self, action: str) -> str:
        """A past action as shown in the history; an empty action (no usable action) is named."""
        return action if action.strip() else NO_ACTION_TEXT


#: The verl_agent templates' closing instruction, ``.format(what=..., example=...)``.
THINK_THEN_ACTION = (
    "Now it is your turn to act. First reason step by step about the current situation; this reasoning MUST "
    "be enclosed in <think> </think> tags. After the reasoning, give exactly one {what} for the current step "
    "inside <action> </action> tags, for example <action>{example}</action>."
)

#: The compact templates' reply instruction, ``.format(what=...)``.
COMPACT_REPLY = "Reply <think>reasoning</think><action>{what}</action>"


@functools.cache
def prompt_templates() -> dict[tuple[str, str], PromptTemplate]:
    """Every template, keyed by (environment name, style): those each registered environment declares in its
    ``RECIPE.templates`` (:mod:`megatron_gigpo.envs.registry`)."""
    from megatron_gigpo.envs.registry import ENVIRONMENTS, env_recipe

    out: dict[tuple[str, str], PromptTemplate] = {}
    for name in ENVIRONMENTS:
        for t in env_recipe(name).templates:
            if t.env != name or (t.env, t.style) in out:
                raise ValueError(f"environment {name!r} declares a template for {t.env!r} / {t.style!r} twice or "
                                 "for another environment")
            out[(t.env, t.style)] = t
    return out


def template_envs(style: str = DEFAULT_PROMPT_STYLE) -> list[str]:
    """The environments that have a template of ``style``, sorted."""
    return sorted(env for env, s in prompt_templates() if s == style)


def get_prompt_template(env_name: str, style: str = DEFAULT_PROMPT_STYLE) -> PromptTemplate:
    """The template registered for ``(env_name, style)``.

    Raises:
        KeyError: no template for that environment, or none of that style (the message lists what exists).
    """
    if (env_name, style) in prompt_templates():
        return prompt_templates()[(env_name, style)]
    if not any(env == env_name for env, _ in prompt_templates()):
        raise KeyError(
            f"no prompt template for environment {env_name!r}; known: {sorted({e for e, _ in prompt_templates()})}"
        )
    styles = sorted(s for e, s in prompt_templates() if e == env_name)
    raise KeyError(f"no {style!r} prompt template for environment {env_name!r}; its styles: {styles}")
