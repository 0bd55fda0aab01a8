"""Sokoban as a text environment (GiGPO paper Sec. 5, verl-agent's Sokoban setting).

Rules, room generation and rewards come from ``gym-sokoban`` (gym 0.26 API; install with
``pip install "setuptools<81" gym==0.26.2 gym-sokoban==0.0.6``): −0.1 per step, +1 when a box reaches a
target, −1 when one leaves it, +10 when all boxes are on targets. Rooms are generated from seeds, so the
environment needs no data. The paper's setting is a 6×6 room with one box and 15 steps.

Observation (and anchor): the grid as text, one row per line, cells separated by a space:

    ``#`` wall, ``_`` floor, ``O`` empty target, ``X`` box, ``√`` box on a target, ``P`` player,
    ``S`` player on a target.

Actions: ``up``, ``down``, ``left``, ``right`` (case-insensitive; the verbal forms ``move up``,
``push up``, ``go up`` are accepted too). Moving into a box pushes it when the cell behind is free.

Invalid (penalised) responses, after verl-agent ``agent_system/environments/env_package/sokoban/projection.py``:
no ``<action>...</action>`` block, no ``<think>``/``</think>`` tags, or an action block naming none of
``up``, ``down``, ``left``, ``right``, ``still`` (the first of these words, in that order, found anywhere in the
lower-cased block is the action). Such a response is a no-op step (``still``, gym-sokoban's action 0, still
costing the −0.1 step penalty). Unlike ALFWorld and WebShop, verl-agent's Sokoban projection has no CJK rule,
and an explicit ``still`` is a valid, unpenalised no-op (not admissible: ``StepResult.action_valid`` False).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import random
import re
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_gigpo.envs.actions import parse_response
from megatron_gigpo.envs.base import Environment, ProjectedAction, ResetResult, StepResult, Task
from megatron_gigpo.envs.expert import Expert, ExpertMove, ExpertUnavailable
from megatron_gigpo.envs.recipe import EnvRecipe
from megatron_gigpo.envs.sokoban_solver import UnsolvableError, solve_grid
from megatron_gigpo.episodes.templates import COMPACT_LAYOUT, COMPACT_REPLY, MINIMAL_LAYOUT, PromptTemplate
from megatron_gigpo.fields import num

if TYPE_CHECKING:
    from megatron_gigpo.episodes.prompts import StepPromptState

log = logging.getLogger(__name__)

ACTIONS: tuple[str, ...] = ("up", "down", "left", "right")
# gym-sokoban action ids: 0 no-op, 1..4 push (or move when no box) up/down/left/right.
_ACTION_IDS = {"up": 1, "down": 2, "left": 3, "right": 4}
_NOOP_ID = 0
#: The no-op action text (verl-agent's "still"); also what an invalid response is projected to.
NOOP_ACTION = "still"
# Words the projection looks for inside the action block, in verl-agent's order (first match wins).
_PROJECTION_WORDS = ("up", "down", "left", "right", NOOP_ACTION)
# gym-sokoban cell codes: 0 wall, 1 floor, 2 target, 3 box on target, 4 box, 5 player; 6 is ours (player
# standing on a target), derived from the fixed layer so that the text shows the target under the player.
_CELL_SYMBOLS = np.array(["#", "_", "O", "√", "X", "P", "S"])
_VERBAL_PREFIX = re.compile(r"^(?:move|push|go|step)\s+")
# Seeds of the val split start here so that train and val rooms never coincide.
VAL_SEED_OFFSET = 1_000_000_000
MAX_STEPS = 15  # episode length (the paper's Sokoban setting): SokobanEnv's default and RECIPE.step_limit
DIM_ROOM = (6, 6)  # rows, columns of a room, outer wall included (the paper's): SokobanEnv's and env.sokoban's default
NUM_BOXES = 1  # boxes (and targets) per room (the paper's): SokobanEnv's and env.sokoban's default

TASK_DESCRIPTION = "Push every box (X) onto a target (O)."


@functools.lru_cache(maxsize=1)
def _import_gym() -> None:
    """Import gym (which gym-sokoban needs) on first use, so that importing this module does not.

    gym prints a notice about its maintenance to stderr on import (from ``gym_notices``); it goes to this
    module's logger at DEBUG instead: the driver's terminal shows the package's INFO lines (the demonstrations
    stage imports gym there), and a pinned library's deprecation notice is not news for a run.
    """
    notice = io.StringIO()
    with contextlib.redirect_stderr(notice):
        import gym  # noqa: F401 - imported for its side effect, once
    if notice.getvalue().strip():
        log.debug("gym on import: %s", notice.getvalue().strip())


@functools.lru_cache(maxsize=1)
def _grid_sokoban_class() -> type:
    """gym-sokoban's SokobanEnv with pixel rendering replaced by the raw grid (text mode needs no image)."""
    _import_gym()
    from gym_sokoban.envs.sokoban_env import SokobanEnv as GymSokobanEnv

    class GridSokoban(GymSokobanEnv):
        def get_image(self, mode, scale=1):  # noqa: ARG002 - gym-sokoban's signature
            return self.room_state

    return GridSokoban


def _make_gym_env(dim_room: tuple[int, int], max_steps: int, num_boxes: int, num_gen_steps: int | None):
    return _grid_sokoban_class()(
        dim_room=dim_room, max_steps=max_steps, num_boxes=num_boxes, num_gen_steps=num_gen_steps, reset=False
    )


def generate_room(
    room_seed: int, dim_room: tuple[int, int], num_boxes: int, num_gen_steps: int, max_attempts: int
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Generate a solvable room deterministically from ``room_seed`` with gym-sokoban's generator.

    gym-sokoban draws from the global ``random`` and ``np.random`` generators and fails (RuntimeError /
    RuntimeWarning) for some walks; attempt ``k`` seeds both generators with a value derived from
    ``(room_seed, k)``, and the caller's global generator states are restored afterwards.

    Returns:
        (room_fixed, room_state, box_mapping): int arrays of shape ``dim_room`` (walls/floor/targets, and
        the full state with boxes and player) and gym-sokoban's target→box mapping.

    Raises:
        RuntimeError: when ``max_attempts`` walks all failed (e.g. too many boxes for the room size).
    """
    _import_gym()
    from gym_sokoban.envs.room_utils import generate_room as gym_generate_room

    py_state, np_state = random.getstate(), np.random.get_state()
    errors = []
    try:
        for attempt in range(max_attempts):
            derived = zlib.crc32(f"{room_seed}/{attempt}".encode()) if attempt else room_seed % 2**32
            random.seed(derived)
            np.random.seed(derived)
            try:
                return gym_generate_room(dim=dim_room, num_steps=num_gen_steps, num_boxes=num_boxes)
            except (RuntimeError, RuntimeWarning) as exc:
                errors.append(str(exc))
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    raise RuntimeError(
        f"Sokoban room generation failed {max_attempts} times for room_seed={room_seed}, dim_room={dim_room}, "
        f"num_boxes={num_boxes}: {errors[-1]}"
    )


def render_grid(room_state: np.ndarray, room_fixed: np.ndarray) -> str:
    """Text grid of a room: rows joined by newlines, cells by spaces (symbols in the module docstring)."""
    codes = np.where((room_state == 5) & (room_fixed == 2), 6, room_state).astype(np.int64)
    return "\n".join(" ".join(row) for row in _CELL_SYMBOLS[codes].tolist())


def parse_direction(action_text: str) -> str | None:
    """``up``/``down``/``left``/``right`` from an action string (case, quotes, verbal prefix ignored), or None."""
    text = action_text.strip().strip("\"'`.!").strip().lower()
    text = _VERBAL_PREFIX.sub("", text)
    return text if text in _ACTION_IDS else None


def load_tasks(split: str, num_tasks: int, first_seed: int = 0) -> list[Task]:
    """A deterministic list of Sokoban tasks: one room seed each.

    Args:
        split: ``train`` (seeds ``first_seed ...``) or ``val`` (seeds from ``VAL_SEED_OFFSET + first_seed``).
        num_tasks: how many tasks (rooms).
        first_seed: offset of the first seed within the split.

    Raises:
        ValueError: unknown split or negative counts.
    """
    if split not in ("train", "val"):
        raise ValueError(f"sokoban load_tasks: split must be 'train' or 'val', got {split!r}")
    if num_tasks < 0 or first_seed < 0:
        raise ValueError(f"sokoban load_tasks: num_tasks={num_tasks} and first_seed={first_seed} must be >= 0")
    base = first_seed + (VAL_SEED_OFFSET if split == "val" else 0)
    return [
        Task(env="sokoban", task_id=str(base + i), split=split, payload={"room_seed": base + i})
        for i in range(num_tasks)
    ]


class SokobanEnv(Environment):
    """One Sokoban episode at a time.

    Args:
        dim_room: (rows, cols) of the room including the outer wall; the paper uses (6, 6).
        num_boxes: boxes (and targets) per room; the paper uses 1.
        max_steps: steps before the episode ends unsolved (15 in the paper).
        num_gen_steps: random-walk length of the room generator (gym-sokoban's default 1.7 × (rows + cols)
            when None).
        max_generation_attempts: generator retries per room before giving up.

    The room of an episode depends only on ``task.payload["room_seed"]``; ``reset``'s ``seed`` is recorded
    but does not change the room (all rollouts of a group must start from the same state).
    """

    name = "sokoban"

    def __init__(
        self,
        dim_room: tuple[int, int] | list[int] = DIM_ROOM,
        num_boxes: int = NUM_BOXES,
        max_steps: int = MAX_STEPS,
        num_gen_steps: int | None = None,
        max_generation_attempts: int = 20,
    ) -> None:
        dim = tuple(int(d) for d in dim_room)
        if len(dim) != 2 or min(dim) < 3:
            raise ValueError(f"SokobanEnv: dim_room must be two sizes >= 3, got {dim_room!r}")
        if num_boxes < 1 or max_steps < 1 or max_generation_attempts < 1:
            raise ValueError(
                f"SokobanEnv: num_boxes={num_boxes}, max_steps={max_steps}, "
                f"max_generation_attempts={max_generation_attempts} must all be >= 1"
            )
        self.dim_room: tuple[int, int] = (dim[0], dim[1])
        self.num_boxes = num_boxes
        self.max_steps = max_steps
        self.num_gen_steps = int(1.7 * sum(self.dim_room)) if num_gen_steps is None else num_gen_steps
        self.max_generation_attempts = max_generation_attempts
        self._game = _make_gym_env(self.dim_room, max_steps, num_boxes, self.num_gen_steps)
        self._active = False

    def reset(self, task: Task, seed: int) -> ResetResult:
        """Generate the task's room and place the player; observation and anchor are the text grid.

        Raises:
            ValueError: the task is not a Sokoban task or lacks ``payload["room_seed"]``.
            RuntimeError: room generation failed (see :func:`generate_room`).
        """
        if task.env != self.name:
            raise ValueError(f"SokobanEnv.reset: task {task.task_id!r} is for env {task.env!r}, not 'sokoban'")
        if "room_seed" not in task.payload:
            raise ValueError(f"SokobanEnv.reset: task {task.task_id!r} payload has no 'room_seed'")
        room_fixed, room_state, box_mapping = generate_room(
            int(task.payload["room_seed"]), self.dim_room, self.num_boxes, self.num_gen_steps,
            self.max_generation_attempts,
        )
        game = self._game
        # The same fields gym-sokoban's own reset() sets after generating a room.
        game.room_fixed, game.room_state, game.box_mapping = room_fixed, room_state, box_mapping
        game.player_position = np.argwhere(room_state == 5)[0]
        game.num_env_steps = 0
        game.reward_last = 0
        game.boxes_on_target = 0
        self._active = True
        grid = render_grid(game.room_state, game.room_fixed)
        return ResetResult(
            observation=grid,
            anchor=grid,
            task_description=TASK_DESCRIPTION,
            admissible_actions=list(ACTIONS),
            info={"room_seed": int(task.payload["room_seed"]), "seed": int(seed)},
        )

    def step(self, action_text: str) -> StepResult:
        """Apply one move. Text that is not a direction is a no-op step (−0.1) with ``action_valid=False``.

        Raises:
            RuntimeError: called before :meth:`reset` or after the episode ended.
        """
        if not self._active:
            raise RuntimeError("SokobanEnv.step called before reset() or after the episode ended")
        direction = parse_direction(action_text)
        game = self._game
        # gym-sokoban ends the episode itself at max_steps (its step limit is ours) or when solved.
        _, reward, done, game_info = game.step(_NOOP_ID if direction is None else _ACTION_IDS[direction])
        done = bool(done)
        won = done and bool(game_info["all_boxes_on_target"])
        self._active = not done
        grid = render_grid(game.room_state, game.room_fixed)
        return StepResult(
            observation=grid,
            anchor=grid,
            reward=float(reward),
            done=done,
            won=won,
            action_valid=direction is not None,
            admissible_actions=list(ACTIONS),
            info={
                "score": game.boxes_on_target / self.num_boxes,
                "boxes_on_target": int(game.boxes_on_target),
                "steps": int(game.num_env_steps),
            },
        )

    def project_action(self, response_text: str, admissible_actions: list[str] | None) -> ProjectedAction:
        """``<think>..</think><action>move up</action>`` → ``up``; the rule is the module docstring's.

        Invalid responses are projected to :data:`NOOP_ACTION`, which :meth:`step` executes as a no-op.
        ``admissible_actions`` is accepted for the common interface; the action set is fixed.
        """
        del admissible_actions
        parsed = parse_response(response_text)
        if parsed.action is None:
            return ProjectedAction(action=NOOP_ACTION, valid=False)
        block = parsed.action.lower()
        word = next((w for w in _PROJECTION_WORDS if w in block), None)
        if word is None:
            return ProjectedAction(action=NOOP_ACTION, valid=False)
        return ProjectedAction(action=word, valid=parsed.has_think)


# ---------------------------------------------------------------------------------------------- recipe hooks
# Training draws ``env.num_groups`` tasks per iteration from this many procedurally generated rooms.
TRAIN_ROOMS = 100_000


@dataclass
class SokobanConfig:
    """``env.sokoban``: the generated rooms."""

    dim_room: list[int] = num(factory=lambda: list(DIM_ROOM), ge=3, length=2)  # rows, columns (outer wall included)
    num_boxes: int = num(NUM_BOXES, ge=1)


def _env_kwargs(env: Any) -> dict[str, Any]:
    return {"dim_room": list(env.sokoban.dim_room), "num_boxes": env.sokoban.num_boxes, "max_steps": env.max_steps}


def _task_list(env: Any, split: str) -> list[Task]:
    """Train: :data:`TRAIN_ROOMS` room seeds from ``env.seed``; val: ``env.val_num_groups`` held-out seeds."""
    return load_tasks(split, num_tasks=TRAIN_ROOMS if split == "train" else env.val_num_groups, first_seed=env.seed)


SOKOBAN_TEMPLATE = PromptTemplate(
    env="sokoban",
    preamble=(
        "You are an expert agent solving a Sokoban puzzle.\n"
        "The grid symbols: # is a wall (nothing passes through it), _ is floor, O is a target, X is a box, "
        "\u221a is a box already on a target, P is you, and S is you standing on a target.\n"
        "Goal: push every box (X) onto a target (O); the puzzle is solved when all boxes are on targets.\n"
        "Rules: each move takes you one square up, down, left or right; walking into a box pushes it one "
        "square further if that square is free. Boxes can be pushed but never pulled, and nothing can be "
        "pushed into a wall, so a box pushed into a corner or along a wall may be stuck for good."
    ),
    task_label="Your task",
    history_intro="each as the grid you saw and the move you made",
    instruction=(
        "Now it is your turn to make one move for the current step. First reason step by step: where are the "
        "boxes and the targets, which path pushes a box towards a target, and which pushes would trap a box "
        "in a corner or against a wall? This reasoning MUST be enclosed in <think> </think> tags. After the "
        "reasoning, give exactly one admissible move inside <action> </action> tags, for example "
        "<action>left</action>."
    ),
)

COMPACT_SOKOBAN_TEMPLATE = PromptTemplate(
    env="sokoban",
    preamble="# wall, _ floor, \u221a box on target, P you, S you on target.",
    task_label="Task",
    history_intro="",
    instruction=COMPACT_REPLY.format(what="up|down|left|right"),
    layout=COMPACT_LAYOUT,
    list_admissible=False,
)

# Only the grids and past moves (templates module docstring): for models trained from random weights.
MINIMAL_SOKOBAN_TEMPLATE = PromptTemplate(
    env="sokoban",
    preamble="",
    task_label="",
    history_intro="",
    instruction="",
    layout=MINIMAL_LAYOUT,
    list_admissible=False,
    system="",
)


class SokobanExpert(Expert):
    """Shortest-plan play: the optimal breadth-first solver of :mod:`megatron_gigpo.envs.sokoban_solver`,
    re-planned from the observation grid at every step (so it recovers from any random move that leaves the room
    solvable). A state no sequence can solve (a box in a deadlock) has no expert move:
    :class:`~megatron_gigpo.envs.expert.ExpertUnavailable`."""

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


RECIPE = EnvRecipe(section="sokoban", settings=SokobanConfig, env_kwargs=_env_kwargs, task_list=_task_list,
                   templates=(SOKOBAN_TEMPLATE, COMPACT_SOKOBAN_TEMPLATE, MINIMAL_SOKOBAN_TEMPLATE),
                   expert=SokobanExpert, step_limit=MAX_STEPS)
