"""The environment registry: names to classes and task lists."""

import inspect

import pytest

from megatron_gigpo.envs.base import Environment
from megatron_gigpo.envs.registry import ENVIRONMENTS, env_class, env_recipe, load_tasks, make_env

pytestmark = pytest.mark.unit


def test_every_registered_environment_resolves():
    for name in ENVIRONMENTS:
        cls = env_class(name)
        assert issubclass(cls, Environment) and cls.name == name


def test_make_env_and_load_tasks_dispatch():
    env = make_env("sokoban", dim_room=(6, 6), max_steps=5)
    tasks = load_tasks("sokoban", "val", num_tasks=2)
    assert [t.env for t in tasks] == ["sokoban", "sokoban"]
    assert env.reset(tasks[0], 0).observation


def test_unknown_names_and_keys():
    with pytest.raises(KeyError, match="unknown environment 'chess'"):
        make_env("chess")
    with pytest.raises(KeyError, match="registered"):
        load_tasks("chess", "train")
    with pytest.raises(TypeError, match="room_size"):
        make_env("sokoban", room_size=6)


def test_step_limit_is_the_environments_own_default():
    for name in ENVIRONMENTS:
        params = inspect.signature(env_class(name)).parameters
        limit = params["max_turns" if "max_turns" in params else "max_steps"].default
        assert env_recipe(name).step_limit == limit, name
