"""Per-step prompts: environment templates, chat rendering and the explicit truncation policy.

Every step of an episode is a fresh, self-contained prompt (GiGPO paper Sec. 5, "memory" of the last K
steps), laid out as verl-agent does (``agent_system/environments/env_manager.py`` ``build_text_obs`` and
``agent_system/environments/prompts/{sokoban,alfworld,webshop,search}.py``): ONE user message per step and no
custom system message (the tokenizer's chat template adds its own default system text, e.g. Qwen2.5's). The
message states, in this order:

1. the environment's preamble (the agent's role and the rules) and the task;
2. from step 2 on, how many steps were taken, then the last K steps written out as plain text inside the
   message: (observation, action) for Sokoban / ALFWorld / WebShop, (search or answer, returned
   ``<information>``) for search QA (:data:`HISTORY_STYLES`); older steps are named as not shown;
3. the current step number and observation (search QA: the newest search result is the last history entry,
   and the question itself is the step-1 observation);
4. the admissible actions, when the environment lists them;
5. the reasoning and output-format instruction: reason inside ``<think> </think>``, then one action inside
   ``<action> </action>`` (search QA: ``<search>`` or ``<answer>``).

Past steps are never replayed as assistant turns: a policy that saw its earlier replies as bare
``<action>x</action>`` turns would imitate them and drop ``<think>``, which the projection penalises
(:mod:`megatron_gigpo.envs.actions`). The message is rendered by the tokenizer's own chat template
(``add_generation_prompt=True``) and tokenized once, so the separators are exactly the template's.

Truncation policy when the rendered prompt exceeds ``max_prompt_length`` tokens (applied in this order,
each stage counted in :class:`RenderedPrompt` and reported by the collector's ``prompt/*`` metrics):

1. drop the oldest history steps, one at a time, down to none;
2. left-truncate the current observation: keep its last tokens (the most recent text), prefixed by
   :data:`TRUNCATION_MARKER`, the largest tail that fits;
3. if the prompt still does not fit with an empty observation (preamble, task, admissible actions and
   instruction alone are too long), raise :class:`PromptTooLongError`. What happens then is the recipe's choice
   (``rollout.prompt_overflow``, one of :data:`PROMPT_OVERFLOW_POLICIES`), applied by the episode collector:

   - ``end_episode`` (default of the shipped recipes): only that trajectory ends, at the step that cannot be
     prompted. Its earlier steps stay training rows with their rewards; the trajectory counts as done and not
     successful, and no row exists for the unpromptable step. An overflow at step 0 leaves no row at all, so
     the trajectory is a failed episode, like one whose environment crashed (listed in
     ``failed_traj_ids``). Every such trajectory is counted in ``episode/prompt_overflow_rate`` and named in
     one warning per collection, never silent. (In ALFWorld a rare state can list very many admissible
     actions; one such state should not stop a multi-hour run.)
   - ``error``: the error propagates and stops the run (a configuration error: raise ``max_prompt_length``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Prefix put before a left-truncated observation so the policy can see that text is missing.
TRUNCATION_MARKER = "[... earlier text truncated ...]\n"
#: History text of a step whose response had no usable action (the environment got an empty action).
NO_ACTION_TEXT = "(no valid action)"
#: How a template writes past steps: ``observation_action`` (the observation the agent saw, then the action
#: it took) or ``action_result`` (the action, then what it returned; the newest result is the current
#: observation).
HISTORY_STYLES: tuple[str, ...] = ("observation_action", "action_result")


#: Values of ``rollout.prompt_overflow``: what the collector does on a :class:`PromptTooLongError`.
PROMPT_OVERFLOW_POLICIES: tuple[str, ...] = ("end_episode", "error")


class PromptTooLongError(ValueError):
    """The fixed part of a prompt (preamble, task, admissible actions, instruction) exceeds ``max_prompt_length``.

    Attributes:
        prompt_tokens: tokens the prompt needs with no history and an empty observation.
        max_prompt_length: the limit it exceeds (tokens).
        env: environment name of the prompt template.
        step: 0-based step index within the episode.
        num_admissible_actions: admissible actions listed in the prompt (0 when the env lists none).
    """

    def __init__(self, prompt_tokens: int, max_prompt_length: int, env: str, step: int, num_admissible_actions: int):
        super().__init__(
            f"prompt needs {prompt_tokens} tokens with no history and an empty observation, more than "
            f"max_prompt_length={max_prompt_length} (environment {env!r}, step {step}, "
            f"{num_admissible_actions} admissible actions); raise max_prompt_length"
        )
        self.prompt_tokens = prompt_tokens
        self.max_prompt_length = max_prompt_length
        self.env = env
        self.step = step
        self.num_admissible_actions = num_admissible_actions

    def __reduce__(self) -> tuple[type, tuple[int, int, str, int, int]]:
        # The message is built from the fields, so pickling (Ray, multiprocessing) must pass the fields.
        fields = (self.prompt_tokens, self.max_prompt_length, self.env, self.step, self.num_admissible_actions)
        return type(self), fields


@dataclass(frozen=True)
class PromptTemplate:
    """The environment-specific wording of the per-step user message (layout in the module docstring).

    Attributes:
        env: environment name the template belongs to.
        preamble: opening paragraph: who the agent is and the environment's rules.
        task_label: how the task line starts (``"<task_label>: <task description>"``).
        history_intro: sentence introducing the shown past steps (what each entry holds).
        instruction: closing paragraph: the reasoning and output-format instruction.
        history_style: one of :data:`HISTORY_STYLES`.
        show_initial_observation: False when the step-1 observation is the task itself (search QA's
            question), so it is not repeated.

    Raises:
        ValueError: an unknown ``history_style``.
    """

    env: str
    preamble: str
    task_label: str
    history_intro: str
    instruction: str
    history_style: str = "observation_action"
    show_initial_observation: bool = True

    def __post_init__(self) -> None:
        if self.history_style not in HISTORY_STYLES:
            raise ValueError(
                f"PromptTemplate {self.env!r}: history_style {self.history_style!r} is not one of {HISTORY_STYLES}"
            )

    def format_action(self, action: str) -> str:
        """A past action as shown in the history; an empty action (no usable action) is named."""
        return action if action.strip() else NO_ACTION_TEXT


_THINK_THEN_ACTION = (
    "Now it is your turn to act. First reason step by step about the current situation; this reasoning MUST "
    "be enclosed in <think> </think> tags. After the reasoning, give exactly one {what} for the current step "
    "inside <action> </action> tags, for example <action>{example}</action>."
)

SOKOBAN_TEMPLATE = PromptTemplate(
    env="sokoban",
    preamble=(
        "You are an expert agent solving a Sokoban puzzle.\n"
        "The grid symbols: # is a wall (nothing passes through it), _ is floor, O is a target, X is a box, "
        "\u221a is a box already on a target, P is you, and S is you standing on a target.\n"
        "Goal: push every box (X) onto a target (O); the puzzle is solved when all boxes are on targets.\n"
        "Rules: each move takes you one square up, down, left or right; walking into a box pushes it one "
        "square further if that square is free. Boxes can be pushed but never pulled, and nothing can be "
        "pushed into a wall, so a box pushed into a corner or along a wall may be stuck for good."
    ),
    task_label="Your task",
    history_intro="each as the grid you saw and the move you made",
    instruction=(
        "Now it is your turn to make one move for the current step. First reason step by step: where are the "
        "boxes and the targets, which path pushes a box towards a target, and which pushes would trap a box "
        "in a corner or against a wall? This reasoning MUST be enclosed in <think> </think> tags. After the "
        "reasoning, give exactly one admissible move inside <action> </action> tags, for example "
        "<action>left</action>."
    ),
)

ALFWORLD_TEMPLATE = PromptTemplate(
    env="alfworld",
    preamble=(
        "You are an expert agent in ALFWorld, a household environment described only through text. You can "
        "go to places, open and close receptacles, take and put objects, and clean, heat, cool, slice or "
        "examine things with the appliances in the room."
    ),
    task_label="Your task",
    history_intro="each as the observation you saw and the action you took",
    instruction=_THINK_THEN_ACTION.format(
        what="admissible action (copied exactly from the list)", example="go to cabinet 1"
    ),
)

WEBSHOP_TEMPLATE = PromptTemplate(
    env="webshop",
    preamble=(
        "You are an expert shopping agent in WebShop, an online store shown as text (page elements are "
        "separated by [SEP]). Find the product the instruction describes: search with search[your query], "
        "open results and choose product options with click[...], and finish with click[buy now] once the "
        "product and its options match the instruction."
    ),
    task_label="Your instruction",
    history_intro="each as the page you saw and the action you took",
    instruction=_THINK_THEN_ACTION.format(what="admissible action", example="search[red cotton t-shirt]"),
)

SEARCH_QA_TEMPLATE = PromptTemplate(
    env="search_qa",
    preamble="You are an expert agent answering a question step by step with the help of a search engine.",
    task_label="Your question",
    history_intro=(
        "each as your action (a query inside <search> </search>) and what the search engine returned "
        "(inside <information> </information>)"
    ),
    instruction=(
        "Now it is your turn to respond for the current step. First reason step by step; this reasoning MUST "
        "be enclosed in <think> </think> tags. After the reasoning, do exactly one of the following, never "
        "both:\n"
        "(1) if some knowledge is missing, search for it by writing a query inside <search> </search> tags; "
        "the results will come back inside <information> </information> tags;\n"
        "(2) if you can answer confidently, give the final answer inside <answer> </answer> tags as a short "
        "phrase without explanation, for example <answer>Paris</answer>."
    ),
    history_style="action_result",
    show_initial_observation=False,
)

PROMPT_TEMPLATES: dict[str, PromptTemplate] = {
    t.env: t for t in (SOKOBAN_TEMPLATE, ALFWORLD_TEMPLATE, WEBSHOP_TEMPLATE, SEARCH_QA_TEMPLATE)
}


def get_prompt_template(env_name: str) -> PromptTemplate:
    """The template registered for ``env_name``; raises KeyError naming the known environments."""
    if env_name not in PROMPT_TEMPLATES:
        raise KeyError(f"no prompt template for environment {env_name!r}; known: {sorted(PROMPT_TEMPLATES)}")
    return PROMPT_TEMPLATES[env_name]


@dataclass(frozen=True)
class RenderedPrompt:
    """One step's prompt after the truncation policy.

    Attributes:
        token_ids: the prompt token ids, ``len <= max_prompt_length``.
        messages: the chat message list the ids are a render of: one ``user`` message (the tokenizer's chat
            template may add its default system text when rendering).
        history_pairs_shown: past steps written out in the message.
        history_pairs_dropped: steps within the K-window removed because of the length limit (stage 1).
        observation_tokens_dropped: tokens cut from the start of the current observation (stage 2).
    """

    token_ids: list[int]
    messages: list[dict[str, str]]
    history_pairs_shown: int
    history_pairs_dropped: int
    observation_tokens_dropped: int

    @property
    def truncated(self) -> bool:
        return self.history_pairs_dropped > 0 or self.observation_tokens_dropped > 0


def format_admissible_actions(actions: Sequence[str]) -> str:
    """Admissible actions as one line: ``"a", "b", "c"`` in the environment's order."""
    return ", ".join(f'"{a}"' for a in actions)


def _progress_note(step: int, first_shown: int, shown: int, history_intro: str) -> str:
    """How many steps were taken before step ``step`` (0-based, > 0) and which of them are shown."""
    note = f"You have already taken {step} step{'' if step == 1 else 's'}."
    if shown == 1:
        note += f" The last one is shown below, {history_intro}."
    elif shown > 1:
        note += f" The last {shown} are shown below, {history_intro}."
    if first_shown == 1:
        note += " (Step 1 is not shown.)"
    elif first_shown > 1:
        note += f" (Steps 1-{first_shown} are not shown.)"
    return note


def encode_chat_prompt(
    tokenizer: Any, messages: Sequence[dict[str, str]], chat_template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """Token ids of the chat-template render of ``messages`` with the generation prompt appended.

    The one place a prompt becomes tokens: rollouts (:meth:`PromptRenderer.encode_messages`) and supervised
    demonstrations (:mod:`megatron_gigpo.sft.data`) both call it, so the policy is trained on exactly the
    token layout it is prompted with. The template's text already contains its special tokens, so it is
    encoded without adding more.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: ``[{"role": ..., "content": ...}, ...]``.
        chat_template_kwargs: extra ``apply_chat_template`` arguments (e.g. ``{"enable_thinking": False}``).
    """
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


class PromptRenderer:
    """Builds and tokenizes per-step prompts for one environment.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (``apply_chat_template``).
        template: the environment's :class:`PromptTemplate`.
        history_length: K, the number of most recent steps shown (>= 0).
        max_prompt_length: token limit of a rendered prompt (> 0).
        chat_template_kwargs: extra keyword arguments for ``apply_chat_template`` (e.g.
            ``{"enable_thinking": False}`` for Qwen3 templates); None for none.

    Raises:
        ValueError: negative ``history_length``, non-positive ``max_prompt_length``, or a tokenizer without
            a chat template.
    """

    def __init__(
        self,
        tokenizer: Any,
        template: PromptTemplate,
        *,
        history_length: int,
        max_prompt_length: int,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if history_length < 0:
            raise ValueError(f"history_length must be >= 0, got {history_length}")
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be > 0, got {max_prompt_length}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template")
        self.tokenizer = tokenizer
        self.template = template
        self.history_length = history_length
        self.max_prompt_length = max_prompt_length
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def build_messages(
        self,
        task_description: str,
        history: Sequence[tuple[str, str]],
        observation: str,
        admissible_actions: Sequence[str] | None,
        step: int,
    ) -> list[dict[str, str]]:
        """The chat message list of step ``step`` (0-based) showing exactly the steps in ``history``.

        Args:
            task_description: the episode's goal, stated after the preamble.
            history: the (observation, executed action) pairs to show, oldest first; they are the steps
                ``step - len(history) .. step - 1``.
            observation: the current observation text.
            admissible_actions: listed before the instruction when not None.
            step: index of the current step within the episode.

        Returns:
            ``[{"role": "user", "content": text}]``: one user message, no system message.

        Raises:
            ValueError: ``history`` holds more pairs than steps were taken.
        """
        if len(history) > step:
            raise ValueError(f"history has {len(history)} pairs but the current step index is {step}")
        t = self.template
        first_shown = step - len(history)
        paragraphs = [t.preamble, f"{t.task_label}: {task_description}"]
        if step > 0:
            paragraphs.append(_progress_note(step, first_shown, len(history), t.history_intro))
        paragraphs.extend(self._history_entries(history, observation, first_shown))
        paragraphs.append(self._current(history, observation, step))
        if admissible_actions is not None:
            listed = format_admissible_actions(admissible_actions)
            paragraphs.append(f"Admissible actions for the current step: [{listed}]")
        paragraphs.append(t.instruction)
        return [{"role": "user", "content": "\n\n".join(paragraphs)}]

    def _history_entries(self, history: Sequence[tuple[str, str]], observation: str, first_shown: int) -> list[str]:
        """One paragraph per shown step, numbered from 1, in the template's history style."""
        entries = []
        for offset, (past_observation, past_action) in enumerate(history):
            n = first_shown + offset + 1
            action = self.template.format_action(past_action)
            if self.template.history_style == "observation_action":
                entries.append(f"[Step {n}] Observation:\n{past_observation}\n[Step {n}] Your action: {action}")
            else:
                # The result of a step is the next step's observation; the newest one is the current observation.
                result = history[offset + 1][0] if offset + 1 < len(history) else observation
                entries.append(f"[Step {n}] Your action: {action}\n[Step {n}] Result:\n{result}")
        return entries

    def _current(self, history: Sequence[tuple[str, str]], observation: str, step: int) -> str:
        """The current step number and the observation (unless the history or the task already holds it)."""
        now = f"You are now at step {step + 1}."
        if self.template.history_style == "action_result":
            if history or (step == 0 and not self.template.show_initial_observation):
                return now
            return f"{now} The result of your last action:\n{observation}"
        if step == 0 and not self.template.show_initial_observation:
            return now
        return f"{now} Current observation:\n{observation}"

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the chat-template render of ``messages`` with the generation prompt appended
        (:func:`encode_chat_prompt`)."""
        return encode_chat_prompt(self.tokenizer, messages, self.chat_template_kwargs)

    def render(
        self,
        task_description: str,
        history: Sequence[tuple[str, str]],
        observation: str,
        admissible_actions: Sequence[str] | None,
    ) -> RenderedPrompt:
        """Render the current step, given the episode's full history, under the truncation policy.

        Args:
            task_description: the episode's goal.
            history: all (observation, executed action) pairs of the episode so far, oldest first; the
                current step index is ``len(history)``.
            observation: the current observation text.
            admissible_actions: the current admissible actions, or None.

        Returns:
            the :class:`RenderedPrompt` (see the module docstring for the policy).

        Raises:
            PromptTooLongError: the prompt does not fit even without history and with an empty observation.
        """
        step = len(history)
        shown = list(history[max(0, len(history) - self.history_length) :]) if self.history_length else []
        window = len(shown)
        while True:
            messages = self.build_messages(task_description, shown, observation, admissible_actions, step)
            ids = self.encode_messages(messages)
            if len(ids) <= self.max_prompt_length:
                return RenderedPrompt(ids, messages, len(shown), window - len(shown), 0)
            if not shown:
                break
            shown = shown[1:]
        return self._truncate_observation(task_description, observation, admissible_actions, step, window)

    def _truncate_observation(
        self,
        task_description: str,
        observation: str,
        admissible_actions: Sequence[str] | None,
        step: int,
        window: int,
    ) -> RenderedPrompt:
        """Stage 2: the largest tail of the observation that fits, found by bisection on its token count."""
        obs_ids = list(self.tokenizer.encode(observation, add_special_tokens=False))

        def attempt(keep: int) -> tuple[list[dict[str, str]], list[int]]:
            tail = self.tokenizer.decode(obs_ids[len(obs_ids) - keep :]) if keep else ""
            messages = self.build_messages(task_description, [], TRUNCATION_MARKER + tail, admissible_actions, step)
            return messages, self.encode_messages(messages)

        best_messages, best_ids = attempt(0)
        if len(best_ids) > self.max_prompt_length:
            raise PromptTooLongError(
                len(best_ids), self.max_prompt_length, self.template.env, step, len(admissible_actions or [])
            )
        best_keep, lo, hi = 0, 1, len(obs_ids) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            messages, ids = attempt(mid)
            if len(ids) <= self.max_prompt_length:
                best_keep, best_messages, best_ids, lo = mid, messages, ids, mid + 1
            else:
                hi = mid - 1
        return RenderedPrompt(best_ids, best_messages, 0, window, len(obs_ids) - best_keep)
