"""Expert policies that play an environment from the same state the policy sees: a registry keyed by env name.

- ``sokoban``: :class:`SokobanExpert`, the optimal breadth-first solver of :mod:`.sokoban_solver`, re-planned
  from the current grid at every step (so it recovers from any random move that leaves the room solvable).
  A state no sequence can solve (a box in a deadlock) has no expert move: :class:`ExpertUnavailable`.
- ``alfworld``: :class:`AlfWorldExpert`, the game's own expert walkthrough (TextWorld's ``walkthrough``
  extra, which :class:`~megatron_gigpo.envs.alfworld.AlfWorldEnv` returns when built with
  ``request_walkthrough=True``). The walkthrough is a fixed command list for the initial state, so after a
  random (epsilon) action it still applies only if that action changed nothing the plan relies on: the
  read-only commands ``look``, ``inventory`` and ``examine ...`` leave it valid; after any other random
  command the expert is lost (:class:`ExpertUnavailable` from then on), and the demonstration writer ends the
  episode there, keeping its rows so far (the random step included).

WebShop and search QA have no expert here; :func:`make_expert` names the environments that do.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from megatron_gigpo.demos.sokoban_solver import UnsolvableError, solve_grid
from megatron_gigpo.envs.actions import match_admissible
from megatron_gigpo.envs.base import ResetResult
from megatron_gigpo.episodes.prompts import StepPromptState

#: ALFWorld commands that change no game state (PDDL effects: none, or only ``checked``), so a walkthrough
#: still applies after them.
ALFWORLD_READ_ONLY = ("look", "inventory")
ALFWORLD_READ_ONLY_PREFIXES = ("examine ",)


class ExpertUnavailable(RuntimeError):
    """The expert has no action from the current state (Sokoban deadlock, ALFWorld off its walkthrough)."""


@dataclass(frozen=True)
class ExpertMove:
    """The expert's choice at one state.

    Attributes:
        action: the action to take now, in the environment's own spelling.
        plan: the remaining plan, starting with ``action`` (what the ``plan`` reasoning describes).
    """

    action: str
    plan: list[str]


class Expert(abc.ABC):
    """An expert policy for one environment, told the reset and every executed action of an episode.

    Attributes:
        env_kwargs: extra constructor arguments of the environment the expert needs (e.g. the walkthrough).
    """

    env_kwargs: ClassVar[dict[str, Any]] = {}

    def start(self, reset: ResetResult) -> None:
        """A new episode began with ``reset``. Default: nothing."""

    @abc.abstractmethod
    def next_move(self, state: StepPromptState) -> ExpertMove:
        """The expert move at ``state``; raises :class:`ExpertUnavailable` when there is none."""

    def taken(self, action: str, by_expert: bool) -> None:
        """``action`` was executed (``by_expert`` False: a random epsilon action). Default: nothing."""

    @abc.abstractmethod
    def describe(self, move: ExpertMove) -> str:
        """The ``plan`` reasoning of ``move``: one short sentence."""


class SokobanExpert(Expert):
    """Shortest-plan play, re-planned from the observation grid at every step."""

    def next_move(self, state: StepPromptState) -> ExpertMove:
        try:
            plan = solve_grid(state.observation)
        except UnsolvableError as exc:
            raise ExpertUnavailable(f"Sokoban: {exc}") from exc
        if not plan:
            raise ExpertUnavailable("Sokoban: the room is solved already")
        return ExpertMove(plan[0], plan)

    def describe(self, move: ExpertMove) -> str:
        return f"Shortest plan: {', '.join(move.plan)}."


class AlfWorldExpert(Expert):
    """The game's walkthrough, step by step (random-action rule in the module docstring)."""

    env_kwargs: ClassVar[dict[str, Any]] = {"request_walkthrough": True}
    #: Plan steps named by the ``plan`` reasoning.
    shown_steps = 3

    def __init__(self) -> None:
        self._walkthrough: list[str] = []
        self._next = 0
        self._lost: str | None = None

    def start(self, reset: ResetResult) -> None:
        if "walkthrough" not in reset.info:
            raise ValueError("AlfWorldExpert needs the environment built with request_walkthrough=True")
        self._walkthrough, self._next, self._lost = list(reset.info["walkthrough"]), 0, None

    def next_move(self, state: StepPromptState) -> ExpertMove:
        if self._lost is not None:
            raise ExpertUnavailable(self._lost)
        if self._next >= len(self._walkthrough):
            raise ExpertUnavailable("ALFWorld: the walkthrough is used up without a win")
        command = self._walkthrough[self._next]
        action = match_admissible(command, state.admissible or [])
        if action is None:
            raise ExpertUnavailable(f"ALFWorld: walkthrough command {command!r} is not admissible here")
        return ExpertMove(action, [action, *self._walkthrough[self._next + 1 :]])

    def taken(self, action: str, by_expert: bool) -> None:
        if by_expert:
            self._next += 1
        elif not (action in ALFWORLD_READ_ONLY or action.startswith(ALFWORLD_READ_ONLY_PREFIXES)):
            self._lost = f"ALFWorld: the random action {action!r} may have changed the state the walkthrough needs"

    def describe(self, move: ExpertMove) -> str:
        more = ", ..." if len(move.plan) > self.shown_steps else ""
        return f"Plan: {', '.join(move.plan[: self.shown_steps])}{more}."


#: Expert policies by environment name.
EXPERTS: dict[str, Callable[[], Expert]] = {"sokoban": SokobanExpert, "alfworld": AlfWorldExpert}


def make_expert(env_name: str) -> Expert:
    """A new expert for ``env_name``.

    Raises:
        ConfigError: no expert is registered for that environment (the message lists those that are).
    """
    from megatron_gigpo.config import ConfigError

    if env_name not in EXPERTS:
        raise ConfigError(
            f"env.name={env_name!r}: no expert policy for demonstrations; experts exist for {', '.join(sorted(EXPERTS))}"
        )
    return EXPERTS[env_name]()
