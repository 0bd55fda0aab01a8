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

The recipe's whole ``env`` section maps onto the registered environment through the functions at the end
(:func:`env_kwargs`, :func:`load_task_list`, :func:`validation_subset`, :func:`check_env_resources`), used by the
driver, the demonstration writer and :mod:`megatron_gigpo.cluster.preflight`.
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


# ----------------------------------------------------------------- the recipe's env section, dispatched by name
def env_kwargs(e: Any) -> dict[str, Any]:
    """Keyword arguments of ``make_env(e.name, **kwargs)`` (plain data, picklable to env workers).

    Raises:
        ValueError: a path the environment needs is not set (the message names the key).
    """
    return env_recipe(e.name).env_kwargs(e)


def load_task_list(e: Any, split: str) -> list[Task]:
    """The deterministic task list of ``split`` (``train`` or ``val``) for the recipe's environment.

    Raises:
        ValueError / FileNotFoundError: a path not set, or data missing (the environment's message).
    """
    return env_recipe(e.name).task_list(e, split)


def _task_kind(task: Task) -> str:
    """ALFWorld's task type or search-QA's data source; "" for environments without kinds."""
    for key in ("task_type", "data_source"):
        if key in task.payload:
            return str(task.payload[key])
    return ""


def validation_subset(tasks: list[Task], n: int) -> list[Task]:
    """``n`` validation tasks that cover every task kind (ALFWorld task type, search-QA data source).

    The split files are ordered by kind (ALFWorld's sorted game folders put one task type last; the Search-R1
    test file is grouped by dataset), so a plain prefix of a capped split would drop whole kinds. Tasks are
    taken round-robin over the kinds, each kind in file order, and returned in file order: deterministic,
    and all tasks when ``n`` covers the split.

    Raises:
        ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"env.val_num_groups must be >= 1, got {n}")
    if n >= len(tasks):
        return list(tasks)
    by_kind: dict[str, list[int]] = {}
    for i, task in enumerate(tasks):
        by_kind.setdefault(_task_kind(task), []).append(i)
    queues = [iter(indices) for indices in by_kind.values()]
    picked: list[int] = []
    while len(picked) < n:
        for queue in queues:
            index = next(queue, None)
            if index is not None and len(picked) < n:
                picked.append(index)
    return [tasks[i] for i in sorted(picked)]


def check_env_resources(e: Any) -> list[str]:
    """Problems (as messages naming the key) that would stop the environment from starting: data and services."""
    return env_recipe(e.name).check_resources(e)
