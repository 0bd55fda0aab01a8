"""Expert demonstrations: the optimal Sokoban solver, the demo writer's rows, epsilon and task rules."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from megatron_gigpo.config import ConfigError, load_config
from megatron_gigpo.demos.experts import ExpertUnavailable, expert_env_names, make_expert
from megatron_gigpo.demos.writer import DemoError, demo_tasks, write_demos
from megatron_gigpo.demos.writer import EXPLORE_REASONING
from megatron_gigpo.envs.registry import load_task_list
from megatron_gigpo.envs.expert import Expert, ExpertMove
from megatron_gigpo.envs.recipe import EnvRecipe
from megatron_gigpo.envs.sokoban import SokobanEnv, load_tasks
from megatron_gigpo.envs.sokoban_solver import UnsolvableError, optimal_moves, parse_grid, solve, solve_grid
from megatron_gigpo.episodes.prompts import PromptTooLongError

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "recipes/smoke/cpu.yaml"


def _cfg(*overrides: str):
    return load_config(SMOKE, ["env.sokoban.dim_room=[6,6]", "env.max_steps=15", *overrides])


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _episodes(rows: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for row in rows:
        out.setdefault(row["episode"], []).append(row)
    return out


# ------------------------------------------------------------------ the solver


@pytest.mark.parametrize(
    "grid, plan",
    [
        ("# # # # #\n# P X O #\n# # # # #", ["right"]),
        # The box must go down: walk round it (up, left), then push.
        ("# # # # # #\n# _ _ _ _ #\n# _ X P _ #\n# _ O _ _ #\n# # # # # #", ["up", "left", "down"]),
        # Two boxes: push the top one in, step back round, push the bottom one in.
        ("# # # # # # #\n# P X O _ _ #\n# _ X O _ _ #\n# # # # # # #", ["right", "left", "down", "right"]),
        # The player starts on the target (S) and must walk round the box to push it back there.
        ("# # # # # #\n# S X _ _ #\n# _ _ _ _ #\n# # # # # #", ["down", "right", "right", "up", "left"]),
    ],
)
def test_known_plans(grid, plan):
    assert solve_grid(grid) == plan


def test_optimal_moves_are_the_first_moves_of_every_shortest_plan():
    # One way round the box (up, left, then push down); left would push the box away, right is longer.
    assert optimal_moves("# # # # # #\n# _ _ _ _ #\n# _ X P _ #\n# _ O _ _ #\n# # # # # #") == {"up"}
    # Two shortest walks to the cell above the box; up and left bump into walls, so they never count.
    room = "# # # # # #\n# P _ _ _ #\n# _ _ _ _ #\n# _ _ X _ #\n# _ _ O _ #\n# # # # # #"
    assert optimal_moves(room) == {"right", "down"}
    assert solve_grid(room)[0] in optimal_moves(room)
    assert optimal_moves("# # # # #\n# P \u221a _ #\n# # # # #") == frozenset()  # solved already
    assert optimal_moves("# # # # #\n# X _ O #\n# _ P _ #\n# # # # #") == frozenset()  # deadlocked


def test_solved_room_and_deadlocks():
    assert solve_grid("# # # # #\n# P \u221a _ #\n# # # # #") == []
    with pytest.raises(UnsolvableError, match="no move sequence"):
        solve_grid("# # # # #\n# X _ O #\n# _ P _ #\n# # # # #")  # the box sits in a corner
    room, state = parse_grid("# # # # # # #\n# P _ X _ O #\n# _ _ _ _ _ #\n# # # # # # #")
    with pytest.raises(UnsolvableError, match="gave up after 3 states"):
        solve(room, state, max_states=3)
    for bad, message in [("# P #\n# X", "differ in length"), ("# P Q #", "unknown symbol 'Q'"),
                         ("# _ X O #", "one player"), ("# P X _ #", "1 boxes but 0 targets")]:
        with pytest.raises(ValueError, match=message):
            parse_grid(bad)


def _gym_shortest(env: SokobanEnv, limit: int) -> int | None:
    """Independent reference: iterative-deepening search with gym-sokoban's own move rule (``_push``)."""
    game = env._game

    def dfs(depth: int) -> bool:
        if game._check_if_all_boxes_on_target():
            return True
        if depth == 0:
            return False
        saved = (game.room_state.copy(), game.player_position.copy())
        for action in (1, 2, 3, 4):
            moved, _ = game._push(action)
            if moved and dfs(depth - 1):
                return True
            game.room_state, game.player_position = saved[0].copy(), saved[1].copy()
        return False

    for depth in range(limit + 1):
        saved = (game.room_state.copy(), game.player_position.copy())
        found = dfs(depth)
        game.room_state, game.player_position = saved
        if found:
            return depth
    return None


@pytest.mark.parametrize("dim", [(5, 5), (6, 6)])
def test_solver_is_optimal_against_iterative_deepening_on_gym_rules(dim):
    env = SokobanEnv(dim_room=dim, max_steps=30)
    checked = 0
    for task in load_tasks("train", 12):
        reset = env.reset(task, seed=0)
        plan = solve_grid(reset.observation)
        if len(plan) > 7:  # keep the brute force small
            continue
        assert _gym_shortest(env, len(plan)) == len(plan), task.task_id
        for i, move in enumerate(plan):  # the plan wins in the real environment, on its last move
            result = env.step(move)
            assert result.done == result.won == (i == len(plan) - 1)
        checked += 1
    assert checked >= 6


# ------------------------------------------------------------------ the writer


def test_sokoban_expert_wins_every_solvable_room_with_shortest_plans(tiny_tokenizer, tmp_path):
    cfg = _cfg()
    out = tmp_path / "demos.jsonl"
    stats = write_demos(cfg, out, num_episodes=40, epsilon=0.0, seed=1, tokenizer=tiny_tokenizer)
    rows = _rows(out)
    episodes = _episodes(rows)
    assert stats.rows == len(rows) and stats.episodes == len(episodes) == 40 and stats.skipped == 0
    env = SokobanEnv(dim_room=(6, 6), max_steps=15)
    tasks = {t.task_id: t for t in demo_tasks(cfg, 40, seed=1)}
    for episode in episodes.values():
        first_plan = solve_grid(env.reset(tasks[episode[0]["task_id"]], 0).observation)
        assert 1 <= len(first_plan) <= cfg.env.max_steps  # generated rooms are solvable within the limit here
        assert [r["action"] for r in episode] == first_plan  # re-planning keeps to one shortest plan
        assert [r["step"] for r in episode] == list(range(len(episode)))
        for row, remaining in zip(episode, range(len(first_plan), 0, -1)):
            user, assistant = row["messages"]
            assert user["role"] == "user" and assistant["role"] == "assistant" and row["expert"]
            plan = first_plan[len(first_plan) - remaining :]
            assert assistant["content"] == f"<think>Shortest plan: {', '.join(plan)}.</think><action>{plan[0]}</action>"
            assert env.project_action(assistant["content"], None).valid
    assert stats.success_rate == 1.0 and stats.end_reasons == {"won": 40}
    assert stats.mean_steps == pytest.approx(len(rows) / 40)


def test_rows_render_the_recipe_prompt_and_reasoning_none(tiny_tokenizer, tmp_path):
    cfg = _cfg("env.prompt_template=compact", "env.history_length=1")
    out = tmp_path / "none.jsonl"
    write_demos(cfg, out, num_episodes=5, seed=2, reasoning="none", tokenizer=tiny_tokenizer)
    rows = _rows(out)
    assert all(r["messages"][1]["content"] == f"<think></think><action>{r['action']}</action>" for r in rows)
    # The compact template with one history step: the previous grid and move, then the current grid.
    later = next(r for r in rows if r["step"] == 1)
    text = later["messages"][0]["content"]
    assert text.startswith("# wall, _ floor") and "Step 1:\n" in text and "\nAction: " in text and "\nNow:\n" in text
    assert text.endswith("<action>up|down|left|right</action>") and "Actions:" not in text
    token_ids = tiny_tokenizer.apply_chat_template(later["messages"][:1], tokenize=True, add_generation_prompt=True,
                                                   return_dict=False)
    assert later["prompt_tokens"] == len(token_ids) <= cfg.rollout.prompt_length


def test_epsilon_share_is_binomial_and_random_rows_say_so(tiny_tokenizer, tmp_path):
    epsilon = 0.25
    out = tmp_path / "eps.jsonl"
    stats = write_demos(_cfg(), out, num_episodes=160, epsilon=epsilon, seed=3, tokenizer=tiny_tokenizer)
    rows = _rows(out)
    random_rows = [r for r in rows if not r["expert"]]
    share = len(random_rows) / len(rows)
    assert stats.random_share == pytest.approx(share) and len(rows) > 400
    assert abs(share - epsilon) <= 4 * math.sqrt(epsilon * (1 - epsilon) / len(rows))
    for row in random_rows:
        assert row["action"] in ("up", "down", "left", "right")
        assert row["messages"][1]["content"] == f"<think>{EXPLORE_REASONING}</think><action>{row['action']}</action>"
    # Random pushes can deadlock a room: those episodes stop (rows kept) and are not won.
    assert 0.0 < stats.success_rate < 1.0 and stats.end_reasons.get("expert_unavailable", 0) > 0
    assert sum(stats.end_reasons.values()) == stats.episodes
    # The same seed writes the same rows.
    again = tmp_path / "eps2.jsonl"
    write_demos(_cfg(), again, num_episodes=20, epsilon=epsilon, seed=3, tokenizer=tiny_tokenizer)
    assert again.read_bytes() == out.read_bytes()[: len(again.read_bytes())] and len(_rows(again)) > 20


def test_only_training_tasks_are_used(tiny_tokenizer, tmp_path):
    cfg = _cfg("env.val_num_groups=500")
    out = tmp_path / "train.jsonl"
    write_demos(cfg, out, num_episodes=30, seed=4, tokenizer=tiny_tokenizer)
    ids = {r["task_id"] for r in _rows(out)}
    val_ids = {t.task_id for t in load_task_list(cfg.env, "val")}
    train_ids = {t.task_id for t in load_task_list(cfg.env, "train")}
    assert ids and ids <= train_ids and not ids & val_ids
    assert all(t.split == "train" for t in demo_tasks(cfg, 30, seed=4))


def test_errors_are_named_and_leave_no_file(tiny_tokenizer, tmp_path):
    out = tmp_path / "keep.jsonl"
    out.write_text("old\n")
    cases = [({"epsilon": 1.5}, "epsilon must be in"), ({"reasoning": "long"}, "reasoning must be one of"),
             ({"num_episodes": 0}, "num_episodes must be >= 1")]
    for kwargs, message in cases:
        args = {"num_episodes": 2, **kwargs}
        with pytest.raises(ValueError, match=message):
            write_demos(_cfg(), out, tokenizer=tiny_tokenizer, **args)
    with pytest.raises(ConfigError, match="env.name='webshop': no expert policy.*alfworld, sokoban"):
        make_expert("webshop")
    # A prompt that cannot fit under prompt_overflow=error stops the writer; the old file stays, no temp file.
    tight = _cfg("rollout.prompt_length=40", "rollout.prompt_overflow=error")
    with pytest.raises(PromptTooLongError):
        write_demos(tight, out, num_episodes=2, tokenizer=tiny_tokenizer)
    assert out.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["keep.jsonl"]
    # Under end_episode the first step's overflow leaves the episode without rows: skipped, not written.
    stats = write_demos(_cfg("rollout.prompt_length=40"), out, num_episodes=2, tokenizer=tiny_tokenizer)
    assert (stats.episodes, stats.skipped, out.read_text()) == (0, 2, "")


def test_expert_unavailable_and_invariants():
    from megatron_gigpo.envs.alfworld import AlfWorldExpert
    from megatron_gigpo.envs.sokoban import SokobanExpert
    from megatron_gigpo.envs.base import ResetResult
    from megatron_gigpo.episodes.prompts import StepPromptState

    with pytest.raises(ExpertUnavailable, match="no move sequence"):
        SokobanExpert().next_move(StepPromptState("t", "# # # # #\n# X _ O #\n# _ P _ #\n# # # # #"))
    expert = AlfWorldExpert()
    with pytest.raises(ValueError, match="request_walkthrough=True"):
        expert.start(ResetResult("obs", "obs", "task", ["look"]))
    expert.start(ResetResult("obs", "obs", "task", ["look"], info={"walkthrough": ["go to desk 1", "take pen 1"]}))
    state = StepPromptState("task", "obs", ["Go To Desk 1", "look"])
    move = expert.next_move(state)
    assert move.action == "Go To Desk 1" and expert.describe(move) == "Plan: Go To Desk 1, take pen 1."
    expert.taken("look", by_expert=False)  # read-only: the walkthrough still applies
    assert expert.next_move(state).action == "Go To Desk 1"
    expert.taken("open drawer 1", by_expert=False)
    with pytest.raises(ExpertUnavailable, match="random action 'open drawer 1'"):
        expert.next_move(state)
    assert issubclass(DemoError, RuntimeError)


class _ToyExpert(Expert):
    def next_move(self, state):
        return ExpertMove("wait", ["wait"])

    def describe(self, move):
        return "Wait."


@dataclasses.dataclass
class _ToySettings:
    pass


#: A new environment's recipe, as its own module would declare it (this test module stands in for that module).
TOY_RECIPE = EnvRecipe(section="toy", settings=_ToySettings, env_kwargs=lambda env: {},
                       task_list=lambda env, split: [], expert=_ToyExpert)


def test_experts_are_declared_by_each_environment_recipe(monkeypatch):
    from megatron_gigpo.envs import registry
    from megatron_gigpo.envs.alfworld import AlfWorldExpert
    from megatron_gigpo.envs.sokoban import SokobanExpert

    assert [registry.env_recipe(n).expert for n in registry.ENVIRONMENTS] == [SokobanExpert, AlfWorldExpert, None, None]
    assert expert_env_names() == ("alfworld", "sokoban")
    assert isinstance(make_expert("sokoban"), SokobanExpert) and make_expert("sokoban") is not make_expert("sokoban")
    with pytest.raises(ConfigError, match=r"^env.name='search_qa': no expert policy for demonstrations; experts exist "
                                          r"for alfworld, sokoban$"):
        make_expert("search_qa")
    # Adding an environment with an expert: its module (RECIPE) and one registry line; nothing in demos/.
    monkeypatch.setitem(registry.ENVIRONMENTS, "toy", registry.EnvSpec(__name__, "SokobanEnv", recipe="TOY_RECIPE"))
    assert isinstance(make_expert("toy"), _ToyExpert) and expert_env_names() == ("alfworld", "sokoban", "toy")
    with pytest.raises(ConfigError, match="experts exist for alfworld, sokoban, toy"):
        make_expert("webshop")
