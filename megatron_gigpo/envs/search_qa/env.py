"""The search-augmented QA environment (Search-R1, arXiv 2503.09516; GiGPO, arXiv 2505.10978, Sec. 5.2).

An episode is one question. Each turn the agent either searches, ``<search>query</search>``, and reads the
top-k passages in an ``<information>...</information>`` observation (Search-R1's layout, or verl-agent's JSON
one: ``information_format``), or answers, ``<answer>text</answer>``,
which ends the episode with reward 1.0 on a normalised exact match with any gold answer (else 0.0).
After ``max_turns`` turns (default 4) the episode ends with reward 0.0 if no answer was given.

Invalid (penalised) responses, after verl-agent ``agent_system/environments/env_package/search/projection.py``
(:func:`project_search_action`): no complete ``<search>...</search>`` or ``<answer>...</answer>`` block, both a
``<search>`` and an ``<answer>`` tag, or more than one tag of a kind. The prompt asks for ``<think>`` first,
but, as in verl-agent, a missing think block is not penalised and there is no CJK rule. The first search block
(else the first answer block) is executed; a response without one sends "" to the environment, a no-op turn
whose observation tells how to search or answer (``StepResult.action_valid`` False). An action block with
empty content is well-formed (not penalised) but, having nothing to search or answer, is such a no-op too.

Anchor (GiGPO step grouping): the raw observation, i.e. the question at reset and the ``<information>``
text after a search; the GiGPO search recipe clusters these by similarity (threshold 0.9) rather than
exact equality, since near-identical retrievals are the same state for grouping purposes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_gigpo.envs.base import Environment, ProjectedAction, ResetResult, StepResult, Task
from megatron_gigpo.envs.search_qa.answers import exact_match
from megatron_gigpo.envs.search_qa.backends import shared_retriever
from megatron_gigpo.envs.search_qa.datasets import ENV_NAME
from megatron_gigpo.envs.search_qa.passages import INFORMATION_FORMATS, Passage, format_information
from megatron_gigpo.envs.search_qa.retriever import Retriever, check_top_k

ACTION_TYPES = ("search", "answer")
MAX_TURNS = 4  # turns of an episode (GiGPO's search setting): SearchQAEnv's default and RECIPE.step_limit
TOP_K = 3  # passages per search (Search-R1's and GiGPO's): SearchQAEnv's default and env.search.top_k's
_ACTION_BLOCK = re.compile(r"<(search|answer)>(.*?)</\1>", re.IGNORECASE | re.DOTALL)
_ACTION_OPEN = re.compile(r"<(?:search|answer)>", re.IGNORECASE)
_SEARCH_BLOCK = re.compile(r"<search>(.*?)</search>", re.IGNORECASE | re.DOTALL)
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_SEARCH_OPEN = re.compile(r"<search>", re.IGNORECASE)
_ANSWER_OPEN = re.compile(r"<answer>", re.IGNORECASE)

INVALID_ACTION_OBSERVATION = (
    "Invalid action. To search, write the query between <search> and </search>. "
    "To give the final answer, write it between <answer> and </answer>."
)


def extract_action(text: str) -> tuple[str, str, int] | None:
    """The single action block of ``text``: (``"search"`` | ``"answer"``, stripped content, block start).

    None when there is no complete block, more than one action tag, or the content is empty.
    """
    blocks = list(_ACTION_BLOCK.finditer(text))
    if len(blocks) != 1 or len(_ACTION_OPEN.findall(text)) != 1:
        return None
    kind, content = blocks[0].group(1).lower(), blocks[0].group(2).strip()
    if not content:
        return None
    return kind, content, blocks[0].start()


def project_search_action(response_text: str) -> ProjectedAction:
    """Map a model response to ``<search>q</search>`` / ``<answer>a</answer>`` and the penalty flag.

    verl-agent's search projection: the first complete search block is the action, else the first complete
    answer block (content stripped), else "" (invalid). Even with an extracted block the response is invalid
    when it holds both a ``<search>`` and an ``<answer>`` tag or more than one tag of a kind (tags matched
    case-insensitively). There is no think-block or CJK rule for search.
    """
    search = _SEARCH_BLOCK.search(response_text)
    answer = None if search is not None else _ANSWER_BLOCK.search(response_text)
    if search is not None:
        action = f"<search>{search.group(1).strip()}</search>"
    elif answer is not None:
        action = f"<answer>{answer.group(1).strip()}</answer>"
    else:
        return ProjectedAction(action="", valid=False)
    n_search, n_answer = len(_SEARCH_OPEN.findall(response_text)), len(_ANSWER_OPEN.findall(response_text))
    valid = not (n_search and n_answer) and n_search <= 1 and n_answer <= 1
    return ProjectedAction(action=action, valid=valid)

class SearchQAEnv(Environment):
    """One search-QA episode at a time over a shared :class:`Retriever`.

    Args:
        retriever: a :class:`Retriever`, or its recipe form ``{"backend": name, **kwargs}`` (e.g.
            ``{"backend": "elasticsearch", "url": ..., "index": ...}``), built once per process through
            :func:`~.backends.shared_retriever`.
        top_k: passages per search (Search-R1 and GiGPO use 3).
        max_turns: turns before the episode is cut off (GiGPO's search setting: 4).
        information_format: layout of the search observation, ``search_r1`` or ``verl_agent`` (see
            :func:`~.passages.format_information`).

    Raises:
        ValueError: ``top_k`` or ``max_turns`` < 1, an unknown ``information_format``, or a retriever mapping
            without ``backend``.
        RetrieverUnavailableError: the retriever's server cannot be reached (names the URL).
    """

    name = ENV_NAME

    def __init__(
        self,
        retriever: Retriever | Mapping[str, Any],
        *,
        top_k: int = TOP_K,
        max_turns: int = MAX_TURNS,
        information_format: str = INFORMATION_FORMATS[0],
    ):
        check_top_k(top_k)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if information_format not in INFORMATION_FORMATS:
            raise ValueError(
                f"unknown information_format {information_format!r}; expected one of {INFORMATION_FORMATS}"
            )
        if isinstance(retriever, Mapping):
            if "backend" not in retriever:
                raise ValueError(f"retriever settings need a 'backend' key, got keys {sorted(retriever)}")
            settings = dict(retriever)
            retriever = shared_retriever(settings.pop("backend"), **settings)
        self.retriever = retriever
        self.top_k = top_k
        self.max_turns = max_turns
        self.information_format = information_format
        self._golden: list[str] | None = None
        self._turn = 0
        self._done = True
        self._prefetched: tuple[str, list[Passage]] | None = None  # (query, hits) from prepare_steps

    def reset(self, task: Task, seed: int) -> ResetResult:
        """Start the episode of ``task``; the observation and anchor are the question (``seed`` is unused:
        the environment is deterministic).

        Raises:
            ValueError: ``task.env`` is not ``search_qa`` or its payload lacks a str ``question`` or a
                non-empty list ``golden_answers``.
        """
        if task.env != ENV_NAME:
            raise ValueError(f"task {task.task_id!r} is for env {task.env!r}, not {ENV_NAME!r}")
        for key in ("question", "golden_answers"):
            if key not in task.payload:
                raise ValueError(f"task {task.task_id!r}: payload has no {key!r} (keys: {sorted(task.payload)})")
        question, golden = task.payload["question"], task.payload["golden_answers"]
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"task {task.task_id!r}: payload['question'] must be a non-empty str, got {question!r}")
        if not isinstance(golden, list) or not golden or not all(isinstance(a, str) for a in golden):
            raise ValueError(f"task {task.task_id!r}: payload['golden_answers'] must be a non-empty list of str")
        self._golden = list(golden)
        self._turn = 0
        self._done = False
        self._prefetched = None
        return ResetResult(observation=question, anchor=question, task_description=question, info={"turn": 0})

    @classmethod
    def prepare_steps(cls, envs: Sequence[Environment], actions: Sequence[str]) -> None:
        """Fetch the hits of every search among ``actions`` with one :meth:`Retriever.batch_search` per
        retriever and ``top_k`` (one request to a retrieval server, one encoder batch for dense retrieval);
        each environment's next :meth:`step` then uses its prefetched hits for the same query."""
        batches: dict[tuple[int, int], list[tuple[SearchQAEnv, str]]] = {}
        for env, action in zip(envs, actions):
            if not isinstance(env, SearchQAEnv):
                continue
            env._prefetched = None
            extracted = extract_action(action)
            if not env._done and extracted is not None and extracted[0] == "search":
                batches.setdefault((id(env.retriever), env.top_k), []).append((env, extracted[1]))
        for (_, top_k), pending in batches.items():
            hits = pending[0][0].retriever.batch_search([query for _, query in pending], top_k)
            for (env, query), passages in zip(pending, hits):
                env._prefetched = (query, passages)

    def step(self, action_text: str) -> StepResult:
        """Run one turn: search, answer, or (unparseable text) an invalid no-op.

        ``action_text`` is a projected action (``<search>q</search>`` / ``<answer>a</answer>``) or a raw
        response; the single action block is extracted from either. ``action_valid`` reports whether one
        non-empty action block could be extracted (reported, not penalised: the penalty flag is
        :meth:`project_action`'s).

        Raises:
            RuntimeError: called before :meth:`reset` or after the episode ended.
            RetrieverUnavailableError: the retriever's server cannot be reached.
        """
        if self._done or self._golden is None:
            raise RuntimeError("SearchQAEnv.step called before reset() or after the episode ended")
        self._turn += 1
        extracted = extract_action(action_text)
        reward, won, done = 0.0, False, False
        info: dict[str, object] = {"turn": self._turn}
        if extracted is None:
            observation = INVALID_ACTION_OBSERVATION
            info["action_type"] = "invalid"
        elif extracted[0] == "search":
            prefetched, self._prefetched = self._prefetched, None
            if prefetched is not None and prefetched[0] == extracted[1]:
                passages = prefetched[1]
            else:
                passages = self.retriever.search(extracted[1], self.top_k)
            observation = format_information(passages, self.information_format)
            info.update(action_type="search", query=extracted[1], retrieved_ids=[p.id for p in passages])
        else:
            won = exact_match(extracted[1], self._golden)
            reward, done, observation = (1.0 if won else 0.0), True, ""
            info.update(action_type="answer", answer=extracted[1], exact_match=won)
        truncated = not done and self._turn >= self.max_turns
        info["truncated"] = truncated
        self._done = done or truncated
        return StepResult(
            observation=observation,
            anchor=observation,
            reward=reward,
            done=self._done,
            won=won,
            action_valid=extracted is not None,
            info=info,
        )

    def project_action(self, response_text: str, admissible_actions: list[str] | None) -> ProjectedAction:
        """See :func:`project_search_action` (search QA has no admissible-action list)."""
        return project_search_action(response_text)
