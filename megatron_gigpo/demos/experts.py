"""The expert of the recipe's environment, for demonstrations: each environment declares its own in its
module's ``RECIPE`` (:class:`megatron_gigpo.envs.recipe.EnvRecipe`, field ``expert``; the interface is
:mod:`megatron_gigpo.envs.expert`), found through :mod:`megatron_gigpo.envs.registry`.

Today: ``sokoban`` (:class:`megatron_gigpo.envs.sokoban.SokobanExpert`, an optimal breadth-first solver
re-planned at every step) and ``alfworld`` (:class:`megatron_gigpo.envs.alfworld.AlfWorldExpert`, the game's
walkthrough); WebShop and search QA have none.
"""

from __future__ import annotations

from megatron_gigpo.envs.expert import Expert, ExpertMove, ExpertUnavailable
from megatron_gigpo.envs.registry import ENVIRONMENTS, env_recipe
from megatron_gigpo.fields import ConfigError

__all__ = ["Expert", "ExpertMove", "ExpertUnavailable", "expert_env_names", "make_expert", "no_expert_message"]


def expert_env_names() -> tuple[str, ...]:
    """The registered environments whose ``RECIPE`` declares an expert, sorted."""
    return tuple(sorted(name for name in ENVIRONMENTS if env_recipe(name).expert is not None))


def no_expert_message(env_name: str) -> str:
    """``"env.name='webshop': no expert policy for demonstrations; experts exist for alfworld, sokoban"``."""
    return (f"env.name={env_name!r}: no expert policy for demonstrations; experts exist for "
            f"{', '.join(expert_env_names())}")


def make_expert(env_name: str) -> Expert:
    """A new expert for ``env_name`` (its ``RECIPE.expert``).

    Raises:
        ConfigError: the environment declares no expert (the message names it and those that have one).
        KeyError: ``env_name`` is not registered.
    """
    factory = env_recipe(env_name).expert
    if factory is None:
        raise ConfigError(no_expert_message(env_name))
    return factory()
