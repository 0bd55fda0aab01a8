"""How a recipe drives one environment: :class:`EnvRecipe`, which every environment module defines once as
``RECIPE`` next to its :class:`~megatron_gigpo.envs.base.Environment` (found through
:mod:`megatron_gigpo.envs.registry`).

An environment's recipe settings are its own dataclass (fields declared with
:func:`megatron_gigpo.fields.num` / :func:`~megatron_gigpo.fields.choice`), mounted as ``env.<section>`` of the
recipe; the shared episode settings (``env.max_steps``, ``env.data_dir``, ``env.seed``, ...) live on
:class:`megatron_gigpo.config.EnvConfig`. The functions below receive that whole ``env`` section.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_gigpo.envs.base import Task

__all__ = ["EnvRecipe", "env_path"]


def _no_problems(env: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class EnvRecipe:
    """One environment's hooks for the recipe.

    Attributes:
        section: the key of its settings under ``env:`` (``env.<section>``).
        settings: the dataclass of ``env.<section>`` (every field with its default and range or choices).
        env_kwargs: ``env section -> dict``: keyword arguments of ``make_env(name, **kwargs)`` (plain,
            picklable data: they travel to the environment workers).
        task_list: ``(env section, split) -> list[Task]``: the deterministic task list of ``train`` or ``val``.
        check_resources: ``env section -> list[str]``: problems (messages naming the key) that would stop the
            environment from starting, such as missing data files or an unreachable service
            (:mod:`megatron_gigpo.cluster.preflight`); default: none.
        templates: its per-step prompt templates, one per style of ``env.prompt_template``
            (:class:`megatron_gigpo.episodes.templates.PromptTemplate`, collected by
            :func:`~megatron_gigpo.episodes.templates.prompt_templates`).
        expert: its expert policy for demonstrations (``megatron-gigpo demos``, the cold start's
            ``sft.demos``): a subclass of :class:`megatron_gigpo.envs.expert.Expert`, built once per
            demonstration run; None (default): the environment has no expert.
        step_limit: the environment's own episode length limit in steps (its constructor's default, the paper's
            setting); the recipe's ``env.max_steps`` is a separate shared setting
            (:class:`megatron_gigpo.config.EnvConfig`). ``benchmarks/envs.py`` runs the environment at it.
            None (default): not stated.
        sample_data: ``folder -> None``: writes a small generated data set in the environment's own file layout
            into ``folder`` (created if missing), to serve as ``env.data_dir`` for benchmarks and smoke runs
            without the real download; None (default): no generator (the environment reads no data folder, or
            only its real data will do).
    """

    section: str
    settings: type
    env_kwargs: Callable[[Any], dict[str, Any]]
    task_list: Callable[[Any, str], list[Task]]
    check_resources: Callable[[Any], list[str]] = _no_problems
    templates: tuple[Any, ...] = ()
    expert: Callable[[], Any] | None = None
    step_limit: int | None = None
    sample_data: Callable[[Path], None] | None = None


def env_path(value: str | None, key: str) -> str:
    """``value`` with ``~`` expanded, for a path setting named ``key``.

    Raises:
        ValueError: ``value`` is None (the message names ``key``).
    """
    if value is None:
        raise ValueError(f"{key} must be set for this environment")
    return str(Path(value).expanduser())


def data_dir_problems(env: Any, task_list: Callable[[Any, str], list[Task]]) -> list[str]:
    """``env.data_dir`` is set and both task lists load from it (for environments that read a data folder).

    Args:
        env: the recipe's ``env`` section (``env.name``, ``env.data_dir``, ...).
        task_list: the environment's own ``(env section, split) -> list[Task]`` (its :attr:`EnvRecipe.task_list`).

    Returns:
        ``["env.data_dir must be set for <name>"]``, or ``["env.data_dir=<dir>: <error>"]`` for the first split
        (``train``, then ``val``) whose task list raises FileNotFoundError or ValueError; [] when both load.
    """
    if env.data_dir is None:
        return [f"env.data_dir must be set for {env.name}"]
    for split in ("train", "val"):
        try:
            task_list(env, split)
        except (FileNotFoundError, ValueError) as exc:
            return [f"env.data_dir={env.data_dir!r}: {exc}"]
    return []
