"""ALFWorld on real shared game files through TextWorld's PDDL engine."""

import shutil

import pytest

from megatron_gigpo.envs.alfworld import TASK_TYPES, AlfWorldEnv, load_tasks, task_type_of
from megatron_gigpo.envs.base import Task

# One game of each kind used below; task files are read from ../shared/data/alfworld.
GAME = "valid_seen/pick_and_place_simple-Book-None-Sofa-229/trial_T20190907_042856_259139/game.tw-pddl"


@pytest.fixture(scope="module")
def data_dir(shared_path):
    shared_path(f"data/alfworld/{GAME}")  # skips, or fails under CI=true, when the game is missing
    return shared_path("data/alfworld")


@pytest.mark.unit
def test_missing_or_empty_data_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="alfworld-download"):
        AlfWorldEnv(data_dir=tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="alfworld-download"):
        load_tasks("val", tmp_path / "nowhere")
    (tmp_path / "valid_seen").mkdir()
    with pytest.raises(FileNotFoundError, match="No ALFWorld game files"):
        load_tasks("val", tmp_path)
    with pytest.raises(FileNotFoundError, match="split folder"):
        load_tasks("train", tmp_path)


@pytest.mark.unit
def test_check_resources_names_env_data_dir(tmp_path):
    from megatron_gigpo.config import EnvConfig
    from megatron_gigpo.envs.registry import check_env_resources

    assert check_env_resources(EnvConfig(name="alfworld")) == ["env.data_dir must be set for alfworld"]
    nowhere = str(tmp_path / "nowhere")
    problems = check_env_resources(EnvConfig(name="alfworld", data_dir=nowhere))
    assert len(problems) == 1 and problems[0].startswith(f"env.data_dir={nowhere!r}: ALFWorld data_dir {nowhere!r}")


@pytest.mark.unit
def test_check_resources_loads_both_splits(data_dir):
    from megatron_gigpo.config import EnvConfig
    from megatron_gigpo.envs.registry import check_env_resources

    env = EnvConfig(name="alfworld", data_dir=str(data_dir))
    # The shared games hold valid_seen and valid_unseen only: the missing train folder is named.
    (problem,) = check_env_resources(env)
    assert problem.startswith(f"env.data_dir={str(data_dir)!r}: ALFWorld split folder") and "/train'" in problem
    env.alfworld.train_split_dir = "valid_unseen"
    assert check_env_resources(env) == []


@pytest.mark.unit
def test_task_lists_are_sorted_and_filtered(data_dir, tmp_path):
    val = load_tasks("val", data_dir)
    assert len(val) == 140
    assert [t.task_id for t in val] == sorted(t.task_id for t in val)
    assert [t.task_id for t in val] == [t.task_id for t in load_tasks("val", data_dir)]
    assert {t.payload["task_type"] for t in val} == set(TASK_TYPES.values())
    unseen = load_tasks("val", data_dir, split_dir="valid_unseen", task_types=[2], num_tasks=3)
    assert len(unseen) == 3 and all(t.payload["task_type"] == "look_at_obj_in_light" for t in unseen)
    assert task_type_of(data_dir / GAME) == "pick_and_place_simple"
    with pytest.raises(ValueError, match="task_types"):
        load_tasks("val", data_dir, task_types=[7])
    # Games marked unsolvable are skipped, as upstream does.
    game_dir = tmp_path / "valid_seen" / "pick_and_place_simple-Book-None-Sofa-1" / "trial_1"
    game_dir.mkdir(parents=True)
    (game_dir / "game.tw-pddl").write_text('{"solvable": false}')
    with pytest.raises(FileNotFoundError, match="No ALFWorld game files"):
        load_tasks("val", tmp_path)


@pytest.mark.integration
def test_walkthrough_wins_with_reward_10(data_dir):
    env = AlfWorldEnv(data_dir=data_dir, request_walkthrough=True)
    task = Task(env="alfworld", task_id=GAME, split="val", payload={"game_file": GAME})
    reset = env.reset(task, seed=0)
    assert reset.task_description == "put a book in sofa."
    assert "-= Welcome" not in reset.observation and reset.anchor == reset.observation
    assert "help" not in reset.admissible_actions and "look" in reset.admissible_actions
    plan = reset.info["walkthrough"]
    assert plan
    for i, command in enumerate(plan):
        step = env.step(command)
        assert step.action_valid
        last = i == len(plan) - 1
        assert (step.done, step.won, step.reward) == (last, last, 10.0 if last else 0.0)
    assert step.info["score"] == 1.0 and step.info["task_type"] == "pick_and_place_simple"
    with pytest.raises(RuntimeError):
        env.step("look")
    # The same instance replays the same game (no reload) and stops at max_steps without a win.
    env.max_steps = 2
    env.reset(task, seed=0)
    bad = env.step("jump over the moon")
    assert not bad.action_valid and bad.observation == "Nothing happens." and not bad.done
    last = env.step("look")
    assert last.action_valid and last.done and not last.won and last.reward == 0.0
    env.close()


@pytest.mark.integration
def test_reset_is_byte_identical_across_instances(data_dir, tmp_path):
    # A copy in another folder: a fresh instance must not depend on anything but the game file.
    copy = tmp_path / GAME
    copy.parent.mkdir(parents=True)
    shutil.copy(data_dir / GAME, copy)
    task = Task(env="alfworld", task_id=GAME, split="val")
    a, b = AlfWorldEnv(data_dir=data_dir), AlfWorldEnv(data_dir=tmp_path)
    ra, rb = a.reset(task, seed=3), b.reset(task, seed=3)
    assert ra.observation.encode() == rb.observation.encode()
    assert ra.admissible_actions == rb.admissible_actions
    sa, sb = a.step(ra.admissible_actions[0]), b.step(rb.admissible_actions[0])
    assert sa.observation.encode() == sb.observation.encode()
    a.close()
    b.close()


@pytest.mark.unit
def test_project_action_and_bad_tasks(data_dir):
    env = AlfWorldEnv(data_dir=data_dir)
    adm = ["go to sofa 1", "look"]
    assert env.project_action("<think>t</think><action>Go to sofa 1</action>", adm).action == "go to sofa 1"
    # verl-agent's ALFWorld rule is the format only: a well-formed command outside the list is valid.
    moon = env.project_action("<think>t</think><action>go to moon</action>", adm)
    assert moon.valid and moon.action == "go to moon"
    assert not env.project_action("<action>look</action>", adm).valid  # no think tags
    assert not env.project_action("<think>\u770b\u770b</think><action>look</action>", adm).valid  # CJK
    no_tag = env.project_action("Let me look around the room first, carefully.", adm)
    assert not no_tag.valid and no_tag.action == "let me look around the room first, carefully."[-30:]
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("look")
    with pytest.raises(ValueError, match="not 'alfworld'"):
        env.reset(Task(env="webshop", task_id=GAME, split="val"), 0)
    with pytest.raises(FileNotFoundError, match="not found"):
        env.reset(Task(env="alfworld", task_id="valid_seen/x/y/game.tw-pddl", split="val"), 0)


@pytest.mark.integration
def test_well_formed_non_admissible_action_is_executed_and_not_penalised(data_dir):
    env = AlfWorldEnv(data_dir=data_dir)
    reset = env.reset(Task(env="alfworld", task_id=GAME, split="val"), seed=0)
    projected = env.project_action("<think>the moon is far</think><action>Go to the Moon</action>",
                                   reset.admissible_actions)
    assert projected.valid and projected.action == "go to the moon"
    step = env.step(projected.action)
    # The game answers, the step is reported as not admissible, and the episode goes on.
    assert step.observation == "Nothing happens." and not step.action_valid and not step.done
    # Without an action block the tail of the response is sent: invalid (penalised), same answer.
    bad = env.project_action("I think I should go to the sofa 1 now.", step.admissible_actions)
    assert not bad.valid and bad.action == "i think i should go to the sofa 1 now."[-30:]
    assert env.step(bad.action).observation == "Nothing happens."
    env.close()
