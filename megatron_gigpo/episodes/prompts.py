"""Per-step prompts: chat rendering, the explicit truncation policy, and the per-episode prompt state.

The wording comes from a template of :mod:`megatron_gigpo.episodes.templates`, chosen by environment and style
(recipe key ``env.prompt_template``: ``verl_agent``, the default described below; ``compact``, the same
order with terse phrases, no progress note and, for Sokoban, no admissible-action line; or ``minimal``, for
Sokoban models trained from random weights: only the history and the current grid, after an empty system
message). The RL collector and
the demonstration writer (:mod:`megatron_gigpo.demos`) build every step's prompt through the same two pieces,
:func:`step_prompt_renderer` and :class:`StepPromptState`, so supervised rows and rollout prompts agree byte
for byte.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_gigpo.episodes.templates import (  # noqa: F401 - re-exported: the prompt API lives here
    DEFAULT_PROMPT_STYLE,
    HISTORY_STYLES,
    NO_ACTION_TEXT,
    PROMPT_STYLES,
    prompt_templates,
    PromptLayout,
    PromptTemplate,
    get_prompt_template,
)

if TYPE_CHECKING:
    from megatron_gigpo.envs.base import ResetResult, StepResult

#: Prefix put before a left-truncated observation so the policy can see that text is missing.
TRUNCATION_MARKER = "[... earlier text truncated ...]\n"
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
class RenderedPrompt:
    """One step's prompt after the truncation policy.

    Attributes:
        token_ids: the prompt token ids, ``len <= max_prompt_length``.
        messages: the chat message list the ids are a render of: one ``user`` message (the tokenizer's chat
            template may add its default system text when rendering), after a ``system`` one when the
            template has its own (:attr:`PromptTemplate.system`).
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


def _progress_note(layout: PromptLayout, step: int, first_shown: int, shown: int, history_intro: str) -> str:
    """How many steps were taken before step ``step`` (0-based, > 0) and which of them are shown."""
    if not layout.taken:
        return ""
    note = layout.taken.format(step=step, s="" if step == 1 else "s")
    if shown == 1:
        note += layout.shown_one.format(shown=shown, intro=history_intro)
    elif shown > 1:
        note += layout.shown_many.format(shown=shown, intro=history_intro)
    if first_shown == 1:
        note += layout.hidden_one
    elif first_shown > 1:
        note += layout.hidden_many.format(last=first_shown)
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
            ``[{"role": "user", "content": text}]``: one user message, after ``{"role": "system", ...}`` when
            the template has a system message of its own.

        Raises:
            ValueError: ``history`` holds more pairs than steps were taken.
        """
        if len(history) > step:
            raise ValueError(f"history has {len(history)} pairs but the current step index is {step}")
        t = self.template
        first_shown = step - len(history)
        paragraphs = [t.preamble, f"{t.task_label}: {task_description}" if t.task_label else ""]
        if step > 0:
            paragraphs.append(_progress_note(t.layout, step, first_shown, len(history), t.history_intro))
        paragraphs.extend(self._history_entries(history, observation, first_shown))
        paragraphs.append(self._current(history, observation, step))
        if admissible_actions is not None and t.list_admissible:
            paragraphs.append(t.layout.admissible.format(actions=format_admissible_actions(admissible_actions)))
        paragraphs.append(t.instruction)
        system = [] if t.system is None else [{"role": "system", "content": t.system}]
        return [*system, {"role": "user", "content": "\n\n".join(p for p in paragraphs if p)}]

    def _history_entries(self, history: Sequence[tuple[str, str]], observation: str, first_shown: int) -> list[str]:
        """One paragraph per shown step, numbered from 1, in the template's history style."""
        entries = []
        layout = self.template.layout
        for offset, (past_observation, past_action) in enumerate(history):
            n = first_shown + offset + 1
            action = self.template.format_action(past_action)
            if self.template.history_style == "observation_action":
                entries.append(layout.observation_action_entry.format(n=n, observation=past_observation, action=action))
            else:
                # The result of a step is the next step's observation; the newest one is the current observation.
                result = history[offset + 1][0] if offset + 1 < len(history) else observation
                entries.append(layout.action_result_entry.format(n=n, action=action, result=result))
        return entries

    def _current(self, history: Sequence[tuple[str, str]], observation: str, step: int) -> str:
        """The current step number and the observation (unless the history or the task already holds it)."""
        layout, number = self.template.layout, step + 1
        if step == 0 and not self.template.show_initial_observation:
            return layout.current_bare.format(step=number)
        if self.template.history_style == "action_result":
            if history:
                return layout.current_bare.format(step=number)
            return layout.current_result.format(step=number, observation=observation)
        return layout.current_observation.format(step=number, observation=observation)

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


def step_prompt_renderer(
    env_name: str,
    tokenizer: Any,
    *,
    history_length: int,
    max_prompt_length: int,
    prompt_style: str = DEFAULT_PROMPT_STYLE,
    template: PromptTemplate | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> PromptRenderer:
    """The renderer of an environment's per-step prompts (the collector's and the demonstrations').

    Args:
        env_name: environment name; with ``prompt_style`` selects the registered template.
        tokenizer: Hugging Face tokenizer with a chat template.
        history_length: K, past steps shown (recipe ``env.history_length``).
        max_prompt_length: token limit (recipe ``rollout.prompt_length``).
        prompt_style: one of :data:`PROMPT_STYLES` (recipe ``env.prompt_template``).
        template: overrides the registered template (custom environments and tests).
        chat_template_kwargs: extra ``apply_chat_template`` arguments.

    Raises:
        KeyError: no template registered for ``(env_name, prompt_style)`` and none given.
        ValueError: see :class:`PromptRenderer`.
    """
    chosen = template if template is not None else get_prompt_template(env_name, prompt_style)
    return PromptRenderer(tokenizer, chosen, history_length=history_length, max_prompt_length=max_prompt_length,
                          chat_template_kwargs=chat_template_kwargs)


@dataclass
class StepPromptState:
    """What an episode's next prompt is rendered from, advanced step by step in one way for every caller.

    Attributes:
        task_description: the episode's goal (from the reset).
        observation: the current observation text.
        admissible: the current admissible actions, or None where the environment lists none.
        history: every (observation, executed action) pair so far, oldest first; ``len(history)`` is the
            0-based index of the current step.
    """

    task_description: str = ""
    observation: str = ""
    admissible: list[str] | None = None
    history: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def from_reset(cls, reset: ResetResult) -> "StepPromptState":
        """The state at step 0 of an episode that reset to ``reset``."""
        return cls(reset.task_description, reset.observation, reset.admissible_actions)

    def render(self, renderer: PromptRenderer) -> RenderedPrompt:
        """The current step's prompt (raises :class:`PromptTooLongError` as :meth:`PromptRenderer.render`)."""
        return renderer.render(self.task_description, self.history, self.observation, self.admissible)

    def advance(self, action: str, result: StepResult) -> None:
        """Record the executed (projected) ``action`` with the observation it answered, then move to ``result``."""
        self.history.append((self.observation, action))
        self.observation, self.admissible = result.observation, result.admissible_actions
