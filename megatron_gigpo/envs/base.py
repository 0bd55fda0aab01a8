"""The environment interface every benchmark implements.

GiGPO groups steps by *anchor state* (paper Sec. 4.2): the environment's raw state, never the rendered prompt
(which carries step counters and history). Each environment therefore returns, next to the text the policy
reads, an ``anchor``: a canonical, hashable description of the state (a string, or a numpy array whose
shape, dtype and bytes define it).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Anchor = str | np.ndarray


@dataclass(frozen=True)
class Task:
    """One task instance: what a group of N rollouts shares.

    Attributes:
        env: environment name (``sokoban``, ``alfworld``, ``search_qa``, ``webshop``).
        task_id: stable identifier, unique within the environment and split (e.g. a game file path,
            a question id, a room seed). Together with ``seed`` it fixes the initial state.
        split: ``train`` or ``val``.
        payload: environment-specific, JSON-serialisable data needed to build the task (question and
            gold answers, product goal, ...).
    """

    env: str
    task_id: str
    split: str
    payload: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass
class ResetResult:
    """What :meth:`Environment.reset` returns.

    Attributes:
        observation: the text the policy reads for the current state.
        anchor: canonical state key for step grouping (raw observation, no history or counters).
        task_description: the goal stated to the agent (ALFWorld "Your task is to: ...", the question, ...).
        admissible_actions: valid action strings where the environment enumerates them, else None.
        info: extra diagnostics (task type, ...).
    """

    observation: str
    anchor: Anchor
    task_description: str
    admissible_actions: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    """What :meth:`Environment.step` returns.

    Attributes:
        observation: text of the next state.
        anchor: canonical key of the next state.
        reward: environment reward of this step (float, the benchmark's units).
        done: the episode ended (win, loss, or the environment's own limit).
        won: the task was solved.
        action_valid: the environment recognised the action as admissible in the state it was taken in
            (ALFWorld: a listed command; WebShop: a search or click offered by the page; Sokoban: a
            direction; search QA: one search or answer block). This is *not* the invalid-action penalty
            flag (that is :attr:`ProjectedAction.valid`): a non-admissible action is still executed and
            reported as ``action/non_admissible_rate`` (see :mod:`megatron_gigpo.envs.actions`).
        admissible_actions: valid actions in the next state, or None.
        info: extra diagnostics (``score``, task type, ...).
    """

    observation: str
    anchor: Anchor
    reward: float
    done: bool
    won: bool
    action_valid: bool
    admissible_actions: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ProjectedAction:
    """A model response mapped to an environment action.

    Attributes:
        action: the action text passed to :meth:`Environment.step` (what each environment sends for a
            response without an action block is documented in its ``project_action``).
        valid: False when the response broke the environment's required format (rules per environment, after
            verl-agent's projections; see :mod:`megatron_gigpo.envs.actions`); the invalid-action penalty
            (algorithm config) applies to exactly these steps. Admissibility is not part of it.
    """

    action: str
    valid: bool


class Environment(abc.ABC):
    """A single, stateful episode environment. Not thread-safe; one per worker slot."""

    name: str = ""

    @abc.abstractmethod
    def reset(self, task: Task, seed: int) -> ResetResult:
        """Start an episode of ``task``; identical (task, seed) must give a byte-identical observation."""

    @abc.abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Apply one projected action; raises RuntimeError if called before reset or after done."""

    @abc.abstractmethod
    def project_action(self, response_text: str, admissible_actions: list[str] | None) -> ProjectedAction:
        """Map a raw model response to the action to execute and the format-validity (penalty) flag."""

    @classmethod
    def prepare_steps(cls, envs: Sequence["Environment"], actions: Sequence[str]) -> None:
        """Called by an environment worker with all of its environments of this class that are about to step,
        and their projected actions, before it calls :meth:`step` on each in turn: a hook to batch work the
        steps share (search QA sends one retrieval request per worker and turn instead of one per slot).

        It must not change any step's result, only how fast it comes; an exception here is ignored by the
        worker (each step then does its own work and reports its own error). Default: nothing.
        """

    def close(self) -> None:
        """Release resources (processes, file handles). Default: nothing."""
