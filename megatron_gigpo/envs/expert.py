"""The interface of an environment's expert policy, used to write demonstrations for a supervised cold start
(``megatron-gigpo demos``, :mod:`megatron_gigpo.demos`).

An environment that has an expert declares it in its module's ``RECIPE``
(:class:`megatron_gigpo.envs.recipe.EnvRecipe`, field ``expert``): a subclass of :class:`Expert`, built anew for
each demonstration run. The demonstration writer tells it every reset and every executed action of an episode
and asks it for the next move at each step's prompt state.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from megatron_gigpo.envs.base import ResetResult

if TYPE_CHECKING:  # episodes.prompts imports the environment modules (their templates) on first use
    from megatron_gigpo.episodes.prompts import StepPromptState

__all__ = ["Expert", "ExpertMove", "ExpertUnavailable"]


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
