"""Sokoban on gym-sokoban: rewards, determinism, task lists, action projection."""

import random
from collections import deque

import numpy as np
import pytest

from megatron_gigpo.envs.base import Task
from megatron_gigpo.envs.sokoban import ACTIONS, NOOP_ACTION, SokobanEnv, load_tasks, parse_direction

pytestmark = pytest.mark.unit

_MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def _parse_grid(text):
    """(walls, targets, boxes, player) from the text observation."""
    walls, targets, boxes, player = set(), set(), set(), None
    for r, row in enumerate(text.split("\n")):
        for c, sym in enumerate(row.split(" ")):
            if sym == "#":
                walls.add((r, c))
            if sym in ("O", "√", "S"):
                targets.add((r, c))
            if sym in ("X", "√"):
                boxes.add((r, c))
            if sym in ("P", "S"):
                player = (r, c)
    return walls, targets, frozenset(boxes), player


def bfs_plan(text):
    """Shortest move sequence solving the room (breadth-first search over player and box positions)."""
    walls, targets, boxes, player = _parse_grid(text)
    start = (player, boxes)
    parents = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        pos, bx = state
        if bx <= targets:
            plan = []
            while parents[state] is not None:
                state, move = parents[state]
                plan.append(move)
            return plan[::-1]
        for move, (dr, dc) in _MOVES.items():
            nxt = (pos[0] + dr, pos[1] + dc)
            if nxt in walls:
                continue
            nbx = bx
            if nxt in bx:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if beyond in walls or beyond in bx:
                    continue
                nbx = (bx - {nxt}) | {beyond}
            child = (nxt, frozenset(nbx))
            if child not in parents:
                parents[child] = (state, move)
                queue.append(child)
    return None


def test_bfs_oracle_earns_the_solve_reward():
    env = SokobanEnv(dim_room=(6, 6), num_boxes=1, max_steps=15)
    solved = 0
    for task in load_tasks("train", num_tasks=6):
        reset = env.reset(task, seed=0)
        assert reset.anchor == reset.observation and reset.admissible_actions == list(ACTIONS)
        plan = bfs_plan(reset.observation)
        assert plan is not None, f"room of task {task.task_id} is unsolvable"
        if len(plan) > env.max_steps:
            continue
        rewards = []
        for i, move in enumerate(plan):
            step = env.step(move)
            rewards.append(step.reward)
            assert step.action_valid
            assert step.done == (i == len(plan) - 1)
        assert step.won and step.info["score"] == 1.0
        # −0.1 every step, +1 for the box reaching its target, +10 for solving, all on the last push.
        assert rewards[-1] == pytest.approx(-0.1 + 1.0 + 10.0)
        assert sum(rewards) == pytest.approx(-0.1 * len(plan) + 11.0)
        with pytest.raises(RuntimeError):
            env.step("up")
        solved += 1
    assert solved >= 3


def test_box_off_target_penalty():
    env = SokobanEnv(dim_room=(7, 7), num_boxes=2, max_steps=200)
    for task in load_tasks("train", num_tasks=20):
        plan = bfs_plan(env.reset(task, 0).observation)
        prefix = None
        for i, move in enumerate(plan or []):  # up to the first box landing on a target
            if env.step(move).reward == pytest.approx(-0.1 + 1.0):
                prefix = plan[: i + 1]
                break
        if prefix is None:
            continue
        for move in ACTIONS:  # some push from there may move that box off again
            env.reset(task, 0)
            for m in prefix:
                env.step(m)
            if env.step(move).reward == pytest.approx(-0.1 - 1.0):
                return
    pytest.fail("no room among 20 allowed pushing a box off its target")


def test_step_limit():
    env = SokobanEnv(max_steps=15)
    task = load_tasks("train", num_tasks=1)[0]
    plan = bfs_plan(env.reset(task, 0).observation)
    env.reset(task, 0)
    for move in plan[:-1]:
        env.step(move)
    # Instead of the final push, walk away and count down the step limit.
    steps = len(plan) - 1
    step = None
    while steps < 15:
        step = env.step("nonsense")
        steps += 1
        assert not step.action_valid and step.reward == pytest.approx(-0.1)
    assert step.done and not step.won


def test_reset_is_byte_identical_across_instances_and_keeps_global_rng():
    tasks = load_tasks("val", num_tasks=5)
    a, b = SokobanEnv(), SokobanEnv()
    random.seed(123)
    np.random.seed(123)
    expect_py, expect_np = random.random(), np.random.rand()
    random.seed(123)
    np.random.seed(123)
    for task in tasks:
        ra, rb = a.reset(task, 7), b.reset(task, 7)
        assert ra.observation.encode() == rb.observation.encode()
        assert a.step("left").observation == b.step("left").observation
    assert random.random() == expect_py and np.random.rand() == expect_np
    rooms = {a.reset(t, 0).observation for t in tasks}
    assert len(rooms) > 1


def test_task_lists_are_deterministic_and_disjoint():
    train, val = load_tasks("train", num_tasks=50), load_tasks("val", num_tasks=50)
    assert [t.task_id for t in train] == [t.task_id for t in load_tasks("train", num_tasks=50)]
    assert not {t.task_id for t in train} & {t.task_id for t in val}
    assert load_tasks("train", num_tasks=3, first_seed=10)[0].payload == {"room_seed": 10}
    with pytest.raises(ValueError, match="split"):
        load_tasks("test", num_tasks=1)


@pytest.mark.parametrize(
    "response, action, valid",
    [
        ("<think>push it</think><action>Up</action>", "up", True),
        ("<think>x</think><action> move left </action>", "left", True),
        ("<think>x</think><action>Push Down.</action>", "down", True),
        ("<think>x</think><action>'right'</action>", "right", True),
        # verl-agent's projection: the first of up/down/left/right/still (in that order) in the block.
        ("<think>x</think><action>left, then up</action>", "up", True),
        # An explicit "still" is a valid no-op; no action word is an invalid one.
        ("<think>x</think><action>Still</action>", NOOP_ACTION, True),
        ("<think>x</think><action>jump</action>", NOOP_ACTION, False),
        # Missing think tags or action block: invalid (the action block is still executed when present).
        ("<action>up</action>", "up", False),
        ("up", NOOP_ACTION, False),
        ("<think>go up</think> up", NOOP_ACTION, False),
        # verl-agent's Sokoban projection has no CJK rule (ALFWorld's and WebShop's do).
        ("<think>\u5411\u4e0a</think><action>up</action>", "up", True),
    ],
)
def test_project_action(response, action, valid):
    projected = SokobanEnv().project_action(response, list(ACTIONS))
    assert (projected.action, projected.valid) == (action, valid)


def test_noop_action_is_a_step_that_is_not_admissible():
    env = SokobanEnv()
    reset = env.reset(load_tasks("train", num_tasks=1)[0], 0)
    step = env.step(NOOP_ACTION)
    assert step.observation == reset.observation and step.reward == pytest.approx(-0.1)
    assert not step.action_valid and not step.done and NOOP_ACTION not in step.admissible_actions


def test_bad_inputs():
    assert parse_direction("north") is None
    env = SokobanEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("up")
    with pytest.raises(ValueError, match="not 'sokoban'"):
        env.reset(Task(env="alfworld", task_id="1", split="train", payload={"room_seed": 1}), 0)
    with pytest.raises(ValueError, match="room_seed"):
        env.reset(Task(env="sokoban", task_id="1", split="train"), 0)
    with pytest.raises(ValueError, match="dim_room"):
        SokobanEnv(dim_room=(2, 6))
    with pytest.raises(RuntimeError, match="generation failed"):
        SokobanEnv(dim_room=(4, 4), num_boxes=6, max_generation_attempts=2).reset(load_tasks("train", 1)[0], 0)


def test_gym_import_notice_stays_off_the_terminal():
    """gym prints a maintenance notice to stderr when imported; the environment logs it at DEBUG instead, so the
    terminal shows only the run's own lines, including under the CLI's console logging (the package's INFO
    records reach the terminal there; the demonstrations stage imports gym in the driver)."""
    import subprocess
    import sys

    code = ("from megatron_gigpo.cli import console_logging\nconsole_logging()\n"
            "from megatron_gigpo.envs.sokoban import generate_room, _grid_sokoban_class\n"
            "generate_room(1, (6, 6), 1, 20, 5)\n_grid_sokoban_class()\nimport gym\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "gym" not in proc.stderr.lower(), proc.stderr
