"""ALFWorld text games (TextWorld PDDL engine), as in the GiGPO paper's ALFWorld benchmark.

Data: the game files of the ALFWorld release, laid out as ``<data_dir>/<split_dir>/<task>/<trial>/game.tw-pddl``
with ``split_dir`` one of ``train``, ``valid_seen``, ``valid_unseen``. Fetch them once with the ``alfworld``
package's downloader::

    pip install alfworld            # pulls textworld[pddl]; no torch needed for the text engine
    alfworld-download               # writes $ALFWORLD_DATA (default ~/.cache/alfworld)/json_2.1.1/...

and set the environment's ``data_dir`` to ``$ALFWORLD_DATA/json_2.1.1``. Each ``game.tw-pddl`` carries its own
PDDL domain, grammar and problem; ``traj_data.json`` is not needed (the task type is the first ``-`` field of
the task folder name, e.g. ``pick_and_place_simple-Book-None-Sofa-229``).

Episode: the observation is TextWorld's feedback text (the intro banner removed); the anchor is the same text
(verl-agent groups ALFWorld steps by the raw observation). Actions are the engine's admissible commands
(``help`` dropped, as in verl-agent). Reward ``win_reward`` (10) on the step that wins, else 0; the episode ends
on a win or after ``max_steps`` (50) steps.

Invalid (penalised) responses, after verl-agent ``agent_system/environments/env_package/alfworld/projection.py``:
no ``<action>...</action>`` block, no ``<think>``/``</think>`` tags, or a CJK ideograph. The lower-cased action
block is sent to the game whether or not it is admissible; a command the game does not know is answered with
"Nothing happens." and is *not* penalised (``StepResult.action_valid`` False, ``action/non_admissible_rate``).
Without an action block the last :data:`MISSING_ACTION_CHARS` characters of the lower-cased response are sent,
as verl-agent does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from dataclasses import dataclass

from megatron_gigpo.envs.actions import match_admissible, project_tagged_action
from megatron_gigpo.envs.base import Environment, ProjectedAction, ResetResult, StepResult, Task
from megatron_gigpo.envs.expert import Expert, ExpertMove, ExpertUnavailable
from megatron_gigpo.envs.recipe import EnvRecipe, data_dir_problems, env_path
from megatron_gigpo.episodes.templates import COMPACT_LAYOUT, COMPACT_REPLY, THINK_THEN_ACTION, PromptTemplate

if TYPE_CHECKING:
    from megatron_gigpo.episodes.prompts import StepPromptState

# ALFWorld's six task types (alfworld.agents.environment.alfred_tw_env.TASK_TYPES), by id.
TASK_TYPES: dict[int, str] = {
    1: "pick_and_place_simple",
    2: "look_at_obj_in_light",
    3: "pick_clean_then_place_in_recep",
    4: "pick_heat_then_place_in_recep",
    5: "pick_cool_then_place_in_recep",
    6: "pick_two_obj_and_place",
}
GAME_FILE = "game.tw-pddl"
MAX_STEPS = 50  # episode length (the paper's ALFWorld setting): AlfWorldEnv's default and RECIPE.step_limit
DEFAULT_SPLIT_DIRS: dict[str, str] = {"train": "train", "val": "valid_seen"}
# Characters of a response without an action block sent as the command (verl-agent's ALFWorld projection).
MISSING_ACTION_CHARS = 30
_BANNER = "-= Welcome to TextWorld, ALFRED! =-"
_TASK_MARKER = "Your task is to: "
_HOW_TO_GET_DATA = (
    "Fetch the ALFWorld games with `pip install alfworld && alfworld-download` (they go to $ALFWORLD_DATA, "
    "default ~/.cache/alfworld) and set the ALFWorld data_dir to $ALFWORLD_DATA/json_2.1.1, the folder that "
    "holds train/, valid_seen/ and valid_unseen/."
)


def _check_data_dir(data_dir: str | Path) -> Path:
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"ALFWorld data_dir {str(path)!r} does not exist or is not a directory. {_HOW_TO_GET_DATA}"
        )
    return path


def task_type_of(game_file: str | Path) -> str:
    """Task type of a game from its task folder name (``<type>-<object>-<mrecep>-<recep>-<scene>``).

    Raises:
        ValueError: the folder name does not start with one of :data:`TASK_TYPES`.
    """
    folder = Path(game_file).parent.parent.name
    task_type = folder.split("-", 1)[0]
    if task_type not in TASK_TYPES.values():
        raise ValueError(f"ALFWorld game {str(game_file)!r}: task folder {folder!r} has no known task type")
    return task_type


def load_tasks(
    split: str,
    data_dir: str | Path,
    split_dir: str | None = None,
    task_types: list[int] | None = None,
    num_tasks: int | None = None,
) -> list[Task]:
    """The sorted, solvable games of one split: a deterministic list, independent of worker count.

    Mirrors ``AlfredTWEnv.collect_game_files`` without needing ``traj_data.json``: games in ``movable``/
    ``Sliced`` folders and games marked unsolvable are skipped (as upstream does).

    Args:
        split: ``train`` or ``val`` (the Task's split).
        data_dir: folder with ``train/``, ``valid_seen/``, ``valid_unseen/``.
        split_dir: sub-folder to read; default ``train`` for train and ``valid_seen`` for val.
        task_types: task-type ids (1..6, :data:`TASK_TYPES`) to keep; all when None.
        num_tasks: keep only the first ``num_tasks`` games of the sorted list.

    Returns:
        Tasks with ``task_id`` = game path relative to ``data_dir`` (posix) and payload
        ``{"game_file": task_id, "task_type": str}``.

    Raises:
        FileNotFoundError: missing data_dir / split folder, or no game files in it (message says how to fetch).
        ValueError: unknown split or task type id.
    """
    if split not in DEFAULT_SPLIT_DIRS:
        raise ValueError(f"alfworld load_tasks: split must be 'train' or 'val', got {split!r}")
    root = _check_data_dir(data_dir)
    sub = DEFAULT_SPLIT_DIRS[split] if split_dir is None else split_dir
    split_path = root / sub
    if not split_path.is_dir():
        raise FileNotFoundError(f"ALFWorld split folder {str(split_path)!r} does not exist. {_HOW_TO_GET_DATA}")
    wanted = set(TASK_TYPES.values())
    if task_types is not None:
        unknown = [t for t in task_types if t not in TASK_TYPES]
        if unknown:
            raise ValueError(f"alfworld load_tasks: unknown task_types {unknown}; valid ids are {sorted(TASK_TYPES)}")
        wanted = {TASK_TYPES[t] for t in task_types}
    tasks = []
    for game in sorted(split_path.glob(f"*/*/{GAME_FILE}")):
        rel = game.relative_to(root).as_posix()
        if "movable" in rel or "Sliced" in rel:
            continue
        task_type = task_type_of(game)
        if task_type not in wanted or not _is_solvable(game):
            continue
        tasks.append(Task(env="alfworld", task_id=rel, split=split, payload={"game_file": rel, "task_type": task_type}))
        if num_tasks is not None and len(tasks) >= num_tasks:
            break
    if not tasks:
        raise FileNotFoundError(
            f"No ALFWorld game files ({GAME_FILE}) of task types {sorted(wanted)} under {str(split_path)!r}. "
            f"{_HOW_TO_GET_DATA}"
        )
    return tasks


def _is_solvable(game: Path) -> bool:
    """The game file's ``solvable`` flag (a bool, or the string "True"/"False" in some releases)."""
    with open(game, encoding="utf-8") as f:
        data = json.load(f)
    if "solvable" not in data:
        return False
    return str(data["solvable"]).lower() == "true"


def _split_intro(feedback: str) -> tuple[str, str]:
    """(observation without the banner, task description) of TextWorld's intro text."""
    text = feedback.replace(_BANNER, "", 1).strip()
    if _TASK_MARKER not in text:
        raise ValueError(f"ALFWorld intro has no {_TASK_MARKER!r}: {text[:200]!r}")
    return text, text.split(_TASK_MARKER, 1)[1].strip()


class AlfWorldEnv(Environment):
    """One ALFWorld game at a time, played through TextWorld's PDDL engine.

    Args:
        data_dir: the folder :func:`load_tasks` read (game paths in tasks are relative to it).
        max_steps: steps before the episode ends unsolved (50 in the paper).
        win_reward: reward of the winning step (10 in the paper).
        request_walkthrough: also return the game's expert walkthrough in ``ResetResult.info["walkthrough"]``
            (list of commands; oracle runs and tests).

    Raises:
        FileNotFoundError: ``data_dir`` does not exist (the message says how to download the games).
    """

    name = "alfworld"

    def __init__(
        self,
        data_dir: str | Path,
        max_steps: int = MAX_STEPS,
        win_reward: float = 10.0,
        request_walkthrough: bool = False,
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"AlfWorldEnv: max_steps must be >= 1, got {max_steps}")
        self.data_dir = _check_data_dir(data_dir)
        self.max_steps = max_steps
        self.win_reward = float(win_reward)
        self.request_walkthrough = request_walkthrough
        self._tw_env: Any = None
        self._loaded_game: Path | None = None
        self._admissible: list[str] = []
        self._steps = 0
        self._active = False
        self._task_type = ""

    def _load(self, game: Path) -> None:
        """Start TextWorld on ``game`` with ALFWorld's name demangler (``drawer 3`` style object names)."""
        import textworld

        # Imported here, not at module level: importing the alfworld package sets $ALFWORLD_DATA and creates
        # its cache folder (alfworld/info.py), which only processes that play ALFWorld should do.
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler

        if self._tw_env is None:
            infos = textworld.EnvInfos(
                won=True, admissible_commands=True, extras=["walkthrough"] if self.request_walkthrough else []
            )
            # shuffle=False: object numbering must not change between resets (anchors, reproducibility).
            self._tw_env = textworld.start(str(game), infos, wrappers=[AlfredDemangler(shuffle=False)])
        elif self._loaded_game != game:
            self._tw_env.load(str(game))
        self._loaded_game = game

    def reset(self, task: Task, seed: int) -> ResetResult:
        """Load the task's game and return its intro. ``seed`` is recorded; ALFWorld games are deterministic.

        Raises:
            ValueError: the task is not an ALFWorld task.
            FileNotFoundError: the game file is missing under ``data_dir``.
        """
        if task.env != self.name:
            raise ValueError(f"AlfWorldEnv.reset: task {task.task_id!r} is for env {task.env!r}, not 'alfworld'")
        game = self.data_dir / task.task_id
        if not game.is_file():
            raise FileNotFoundError(
                f"ALFWorld game {str(game)!r} (task {task.task_id!r}) not found. {_HOW_TO_GET_DATA}"
            )
        self._load(game)
        state = self._tw_env.reset()
        observation, description = _split_intro(state.feedback)
        self._admissible = self._admissible_of(state)
        self._steps = 0
        self._active = True
        self._task_type = task_type_of(game)
        info: dict[str, Any] = {"task_type": self._task_type, "seed": int(seed)}
        if self.request_walkthrough:
            info["walkthrough"] = list(state["extra.walkthrough"])
        return ResetResult(
            observation=observation,
            anchor=observation,
            task_description=description,
            admissible_actions=list(self._admissible),
            info=info,
        )

    @staticmethod
    def _admissible_of(state: Any) -> list[str]:
        return [c for c in state["admissible_commands"] if c != "help"]

    def step(self, action_text: str) -> StepResult:
        """Send one command. A non-admissible command is still sent (TextWorld answers "Nothing happens.").

        ``action_valid`` says whether the command was admissible (matched case- and whitespace-insensitively,
        then sent in the game's spelling); it is reported, not penalised.

        Raises:
            RuntimeError: called before :meth:`reset` or after the episode ended.
        """
        if not self._active:
            raise RuntimeError("AlfWorldEnv.step called before reset() or after the episode ended")
        matched = match_admissible(action_text, self._admissible)
        state, _, _ = self._tw_env.step(matched if matched is not None else action_text.strip())
        self._steps += 1
        won = bool(state["won"])
        done = won or self._steps >= self.max_steps
        self._active = not done
        self._admissible = self._admissible_of(state)
        observation = state.feedback.strip()
        return StepResult(
            observation=observation,
            anchor=observation,
            reward=self.win_reward if won else 0.0,
            done=done,
            won=won,
            action_valid=matched is not None,
            admissible_actions=list(self._admissible),
            info={"score": 1.0 if won else 0.0, "task_type": self._task_type, "steps": self._steps},
        )

    def project_action(self, response_text: str, admissible_actions: list[str] | None) -> ProjectedAction:
        """The lower-cased ``<action>`` text, valid iff the format rule of the module docstring holds.

        ``admissible_actions`` is not consulted: admissibility is the game's answer, not a penalty.
        """
        del admissible_actions
        return project_tagged_action(response_text, MISSING_ACTION_CHARS)

    def close(self) -> None:
        if self._tw_env is not None:
            self._tw_env.close()
            self._tw_env = None
            self._loaded_game = None


# ---------------------------------------------------------------------------------------------- recipe hooks
@dataclass
class AlfWorldConfig:
    """``env.alfworld``: sub-folders of ``env.data_dir`` read for each split (``alfworld-download`` layout)."""

    train_split_dir: str = "train"
    val_split_dir: str = "valid_seen"


def _env_kwargs(env: Any) -> dict[str, Any]:
    return {"data_dir": env_path(env.data_dir, "env.data_dir"), "max_steps": env.max_steps}


def _task_list(env: Any, split: str) -> list[Task]:
    split_dir = env.alfworld.train_split_dir if split == "train" else env.alfworld.val_split_dir
    return load_tasks(split, data_dir=env_path(env.data_dir, "env.data_dir"), split_dir=split_dir)


def _check_resources(env: Any) -> list[str]:
    """``env.data_dir`` is set and both splits' game folders load (:func:`.recipe.data_dir_problems`)."""
    return data_dir_problems(env, _task_list)


ALFWORLD_TEMPLATE = PromptTemplate(
    env="alfworld",
    preamble=(
        "You are an expert agent in ALFWorld, a household environment described only through text. You can "
        "go to places, open and close receptacles, take and put objects, and clean, heat, cool, slice or "
        "examine things with the appliances in the room."
    ),
    task_label="Your task",
    history_intro="each as the observation you saw and the action you took",
    instruction=THINK_THEN_ACTION.format(
        what="admissible action (copied exactly from the list)", example="go to cabinet 1"
    ),
)

COMPACT_ALFWORLD_TEMPLATE = PromptTemplate(
    env="alfworld",
    preamble="ALFWorld: a text household. Act with one admissible command per step.",
    task_label="Task",
    history_intro="",
    instruction=COMPACT_REPLY.format(what="one action from the list"),
    layout=COMPACT_LAYOUT,
)


# ---------------------------------------------------------------------------------------------- expert
#: ALFWorld commands that change no game state (PDDL effects: none, or only ``checked``), so a walkthrough
#: still applies after them.
ALFWORLD_READ_ONLY = ("look", "inventory")
ALFWORLD_READ_ONLY_PREFIXES = ("examine ",)


class AlfWorldExpert(Expert):
    """The game's own expert walkthrough, step by step (TextWorld's ``walkthrough`` extra, which
    :class:`AlfWorldEnv` returns when built with ``request_walkthrough=True``).

    The walkthrough is a fixed command list for the initial state, so after a random (epsilon) action it still
    applies only if that action changed nothing the plan relies on: the read-only commands ``look``,
    ``inventory`` and ``examine ...`` leave it valid; after any other random command the expert is lost
    (:class:`~megatron_gigpo.envs.expert.ExpertUnavailable` from then on), and the demonstration writer ends the
    episode there, keeping its rows so far (the random step included).
    """

    env_kwargs: ClassVar[dict[str, Any]] = {"request_walkthrough": True}
    #: Plan steps named by the ``plan`` reasoning.
    shown_steps = 3

    def __init__(self) -> None:
        self._walkthrough: list[str] = []
        self._next = 0
        self._lost: str | None = None

    def start(self, reset: ResetResult) -> None:
        if "walkthrough" not in reset.info:
            raise ValueError("AlfWorldExpert needs the environment built with request_walkthrough=True")
        self._walkthrough, self._next, self._lost = list(reset.info["walkthrough"]), 0, None

    def next_move(self, state: StepPromptState) -> ExpertMove:
        if self._lost is not None:
            raise ExpertUnavailable(self._lost)
        if self._next >= len(self._walkthrough):
            raise ExpertUnavailable("ALFWorld: the walkthrough is used up without a win")
        command = self._walkthrough[self._next]
        action = match_admissible(command, state.admissible or [])
        if action is None:
            raise ExpertUnavailable(f"ALFWorld: walkthrough command {command!r} is not admissible here")
        return ExpertMove(action, [action, *self._walkthrough[self._next + 1 :]])

    def taken(self, action: str, by_expert: bool) -> None:
        if by_expert:
            self._next += 1
        elif not (action in ALFWORLD_READ_ONLY or action.startswith(ALFWORLD_READ_ONLY_PREFIXES)):
            self._lost = f"ALFWorld: the random action {action!r} may have changed the state the walkthrough needs"

    def describe(self, move: ExpertMove) -> str:
        more = ", ..." if len(move.plan) > self.shown_steps else ""
        return f"Plan: {', '.join(move.plan[: self.shown_steps])}{more}."


RECIPE = EnvRecipe(section="alfworld", settings=AlfWorldConfig, env_kwargs=_env_kwargs, task_list=_task_list,
                   check_resources=_check_resources, templates=(ALFWORLD_TEMPLATE, COMPACT_ALFWORLD_TEMPLATE),
                   expert=AlfWorldExpert, step_limit=MAX_STEPS)
