"""Environments by name: ``make_env(name, **kwargs)``, ``load_tasks(name, split, **kwargs)`` and the recipe
hooks ``env_recipe(name)``.

Each entry names a module, its :class:`~megatron_gigpo.envs.base.Environment` subclass, and the module-level
function that returns the deterministic task list of a split. Modules import no heavy dependency at import
time (gym, textworld and tantivy are imported when an environment is built).

To add an environment: write its module (the Environment subclass; ``load_tasks(split: str, **kwargs) ->
list[Task]``, or name another function in ``EnvSpec.task_loader``; and ``RECIPE``, a
:class:`~megatron_gigpo.envs.recipe.EnvRecipe` with its settings dataclass, the mapping of the recipe's
``env`` section onto its constructor and task list, its resource check, its prompt templates and, optionally,
its expert policy for demonstrations), and add
one line to :data:`ENVIRONMENTS`:
``"name": EnvSpec("package.module", "Class")``. The recipe's ``env.name`` choices and its ``env.<section>``
settings follow from this table (:class:`megatron_gigpo.config.EnvConfig`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from megatron_gigpo.envs.base import Environment, Task
from megatron_gigpo.envs.recipe import EnvRecipe


@dataclass(frozen=True)
class EnvSpec:
    """Where an environment lives.

    Attributes:
        module: importable module path.
        env_class: name of the Environment subclass in ``module``.
        task_loader: name of the task-list function in ``module``.
        recipe: name of the module's :class:`~megatron_gigpo.envs.recipe.EnvRecipe`.
    """

    module: str
    env_class: str
    task_loader: str = "load_tasks"
    recipe: str = "RECIPE"


ENVIRONMENTS: dict[str, EnvSpec] = {
    "sokoban": EnvSpec("megatron_gigpo.envs.sokoban", "SokobanEnv"),
    "alfworld": EnvSpec("megatron_gigpo.envs.alfworld", "AlfWorldEnv"),
    "webshop": EnvSpec("megatron_gigpo.envs.webshop", "WebShopEnv"),
    "search_qa": EnvSpec("megatron_gigpo.envs.search_qa", "SearchQAEnv"),
}


def _spec(name: str) -> EnvSpec:
    if name not in ENVIRONMENTS:
        raise KeyError(f"unknown environment {name!r}; registered: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name]


def env_class(name: str) -> type[Environment]:
    """The Environment subclass registered as ``name``.

    Raises:
        KeyError: ``name`` is not registered.
    """
    spec = _spec(name)
    return getattr(importlib.import_module(spec.module), spec.env_class)


def make_env(name: str, **kwargs: Any) -> Environment:
    """A new environment instance: ``ENVIRONMENTS[name]``'s class called with ``kwargs``.

    Raises:
        KeyError: ``name`` is not registered.
        TypeError: ``kwargs`` holds a key the environment does not take (the message names it).
    """
    return env_class(name)(**kwargs)


def load_tasks(name: str, split: str, **kwargs: Any) -> list[Task]:
    """The deterministic task list of ``split`` for environment ``name`` (same in every process/worker).

    Raises:
        KeyError: ``name`` is not registered.
    """
    spec = _spec(name)
    return getattr(importlib.import_module(spec.module), spec.task_loader)(split, **kwargs)


def env_recipe(name: str) -> EnvRecipe:
    """The recipe hooks of environment ``name`` (its settings dataclass, kwargs and task-list mapping, resource
    check).

    Raises:
        KeyError: ``name`` is not registered.
    """
    spec = _spec(name)
    return getattr(importlib.import_module(spec.module), spec.recipe)


def env_sections() -> dict[str, tuple[str, type]]:
    """``{section: (environment name, settings dataclass)}`` of every registered environment, in table order:
    the ``env.<section>`` sub-sections of the recipe."""
    out: dict[str, tuple[str, type]] = {}
    for name in ENVIRONMENTS:
        recipe = env_recipe(name)
        if recipe.section in out:
            raise ValueError(f"environments {out[recipe.section][0]!r} and {name!r} both claim env.{recipe.section}")
        out[recipe.section] = (name, recipe.settings)
    return out
