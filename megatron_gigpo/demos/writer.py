"""Play an expert through the RL collector's own per-step prompts and write each step as one chat row (JSONL).

Every prompt is rendered exactly as :class:`~megatron_gigpo.episodes.collector.EpisodeCollector` renders it:
the same renderer (:func:`~megatron_gigpo.episodes.prompts.step_prompt_renderer` with the recipe's
:func:`~megatron_gigpo.builders.step_prompt_settings`: template style, ``env.history_length``,
``rollout.prompt_length`` and its truncation), the same prompt state (:class:`~megatron_gigpo.episodes.prompts.
StepPromptState`: observation text, admissible actions, history of executed actions), the same environment
(``make_env(env.name, **env_kwargs(env))``) and the same step limit (``env.max_steps``).

One row per step::

    {"messages": [{"role": "user", "content": <rendered user message>},
                  {"role": "assistant", "content": "<think>{reasoning}</think><action>{action}</action>"}],
     "task_id": ..., "episode": i, "step": t, "action": ..., "expert": true, "prompt_tokens": n}

Keys besides ``messages`` are metadata for inspection; supervised fine-tuning reads ``messages`` only. The
rows carry the prompt's messages as the collector sends them: no system message (the tokenizer's chat
template adds its default system text to both alike), or the template's own (``minimal``: an empty one)
before the user message. Reasoning ``plan`` writes the expert's short plan sentence (Sokoban:
``Shortest plan: up, left, left.``), ``none`` an empty think block; an epsilon step (a uniformly random
admissible action, recorded as taken, ``"expert": false``) writes :data:`EXPLORE_REASONING` under ``plan``.
Every response is checked with the environment's own ``project_action``: valid, and projected to the intended
action.

An episode ends when the environment says done, at ``env.max_steps``, when the prompt cannot fit
(``rollout.prompt_overflow``: ``end_episode`` keeps the rows so far, ``error`` raises), or when the expert has
no move (a deadlocked Sokoban room after a random push; ALFWorld after a random command that leaves its
walkthrough, see :class:`megatron_gigpo.envs.alfworld.AlfWorldExpert`): rows so far are kept, the episode is not won. An episode whose very first
state has no expert move (an unsolvable room) writes no row and is counted in ``skipped``.

Demonstrations use training tasks only (``load_task_list(env, "train")``, in :func:`epoch_order`'s shuffled
passes); a training task id that also appears in the validation list is an error.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_gigpo.config import Config
from megatron_gigpo.demos.config import REASONING_MODES
from megatron_gigpo.demos.experts import Expert, ExpertUnavailable, make_expert
from megatron_gigpo.files import write_text_atomic
from megatron_gigpo.envs.base import Environment, Task
from megatron_gigpo.episodes.prompts import PromptRenderer, PromptTooLongError, StepPromptState

log = logging.getLogger(__name__)

#: Reasoning written (under ``plan``) for an epsilon step: the action is random, not the expert's plan.
EXPLORE_REASONING = "Exploring: a random action."


class DemoError(RuntimeError):
    """A demonstration step broke an invariant (a response the environment would not project to its action)."""


@dataclass
class DemoStats:
    """What :func:`write_demos` wrote.

    Attributes:
        episodes: episodes played (at least one row each).
        skipped: episodes whose first state had no expert move (no rows).
        rows: JSONL rows written (= steps played).
        won: played episodes that were solved.
        random_steps: rows whose action was a random (epsilon) one.
        truncated_prompts: rows whose prompt was truncated to fit ``rollout.prompt_length``.
        end_reasons: played episodes by how they ended (``won``, ``done``, ``step_limit``, ``expert_unavailable``,
            ``prompt_overflow``).
        elapsed_s: wall time of playing and writing, in seconds (loading the tokenizer and task lists excluded).
    """

    episodes: int = 0
    skipped: int = 0
    rows: int = 0
    won: int = 0
    random_steps: int = 0
    truncated_prompts: int = 0
    end_reasons: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def success_rate(self) -> float:
        return self.won / self.episodes if self.episodes else 0.0

    @property
    def mean_steps(self) -> float:
        return self.rows / self.episodes if self.episodes else 0.0

    @property
    def random_share(self) -> float:
        return self.random_steps / self.rows if self.rows else 0.0

    @property
    def episodes_per_s(self) -> float:
        return (self.episodes + self.skipped) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(success_rate=self.success_rate, mean_steps=self.mean_steps, random_share=self.random_share,
                   episodes_per_s=self.episodes_per_s)
        return out


@dataclass
class _Episode:
    rows: list[dict[str, Any]]
    won: bool
    end_reason: str
    random_steps: int
    truncated_prompts: int


def demo_tasks(cfg: Config, num_episodes: int, seed: int) -> list[Task]:
    """``num_episodes`` training tasks in shuffled passes over the training list (:func:`epoch_order`).

    Raises:
        ValueError: a training task id is also a validation task id (e.g. ALFWorld with
            ``env.alfworld.train_split_dir`` equal to ``val_split_dir``), or ``num_episodes`` < 1.
    """
    from megatron_gigpo.builders import epoch_order
    from megatron_gigpo.envs.registry import load_task_list

    if num_episodes < 1:
        raise ValueError(f"num_episodes must be >= 1, got {num_episodes}")
    train = load_task_list(cfg.env, "train")
    val_ids = {t.task_id for t in load_task_list(cfg.env, "val")}
    shared = sorted(val_ids.intersection(t.task_id for t in train))
    if shared:
        raise ValueError(
            f"env {cfg.env.name!r}: {len(shared)} training task(s) are also validation tasks (e.g. {shared[0]!r}); "
            "demonstrations must use training tasks only"
        )
    return [train[i] for i in epoch_order(len(train), seed, 0, num_episodes)]


def response_text(reasoning: str, action: str) -> str:
    """The assistant reply of one row: ``<think>{reasoning}</think><action>{action}</action>``."""
    return f"<think>{reasoning}</think><action>{action}</action>"


def play_episode(
    env: Environment,
    expert: Expert,
    renderer: PromptRenderer,
    task: Task,
    *,
    reset_seed: int,
    max_steps: int,
    epsilon: float,
    rng: random.Random,
    reasoning: str,
    prompt_overflow: str = "end_episode",
) -> _Episode:
    """Play one episode of ``task`` and return its rows (the module docstring's rules).

    ``rng`` draws one number per step (epsilon) and, on epsilon steps, the random action.

    Raises:
        DemoError: a response does not project to its action.
        PromptTooLongError: a prompt cannot fit and ``prompt_overflow`` is ``"error"``.
    """
    reset = env.reset(task, reset_seed)
    expert.start(reset)
    state = StepPromptState.from_reset(reset)
    rows: list[dict[str, Any]] = []
    won, end_reason, random_steps, truncated = False, "step_limit", 0, 0
    for step in range(max_steps):
        try:
            prompt = state.render(renderer)
        except PromptTooLongError:
            if prompt_overflow == "error":
                raise
            end_reason = "prompt_overflow"
            break
        try:
            move = expert.next_move(state)
        except ExpertUnavailable as exc:
            log.debug("task %s step %d: %s", task.task_id, step, exc)
            end_reason = "expert_unavailable"
            break
        explore = rng.random() < epsilon
        if explore:
            if not state.admissible:
                raise DemoError(f"env {env.name!r} lists no admissible actions to draw a random (epsilon) one from")
            action, think = rng.choice(state.admissible), EXPLORE_REASONING
        else:
            action, think = move.action, expert.describe(move)
        response = response_text(think if reasoning == "plan" else "", action)
        projected = env.project_action(response, state.admissible)
        if not projected.valid or projected.action != action:
            raise DemoError(f"task {task.task_id!r} step {step}: response {response!r} projects to {projected}, "
                            f"not the valid action {action!r}")
        result = env.step(projected.action)
        rows.append({
            "messages": [*prompt.messages, {"role": "assistant", "content": response}],
            "task_id": task.task_id, "step": step, "action": action, "expert": not explore,
            "prompt_tokens": len(prompt.token_ids),
        })
        random_steps += int(explore)
        truncated += int(prompt.truncated)
        expert.taken(action, by_expert=not explore)
        state.advance(projected.action, result)
        if result.done:
            won, end_reason = bool(result.won), "won" if result.won else "done"
            break
    return _Episode(rows, won, end_reason, random_steps, truncated)


def _load_tokenizer(cfg: Config) -> Any:
    from transformers import AutoTokenizer

    from megatron_gigpo.models.builtin import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(cfg.model.path, cfg.model.revision)))


#: ``<out>.partial``: the rows of the episodes finished so far; ``<out>.partial.json``: where to resume.
PARTIAL_SUFFIX = ".partial"
#: A progress line every this many seconds, or per tenth of the episodes, whichever comes first.
PROGRESS_EVERY_S = 60.0


class _PartialFile:
    """The demonstrations written so far, kept across an interruption so that the same command resumes.

    ``<out>.partial`` gets each finished episode's rows in one flushed write; ``<out>.partial.json`` (replaced
    atomically after each episode) holds the arguments, the next episode index, the byte length of the rows
    that belong to finished episodes, the statistics and the epsilon RNG's state. A torn tail (a kill during a
    write) is cut at that length on resume.
    """

    def __init__(self, out: Path, args: dict[str, Any]):
        self.out, self.args = out, args
        self.rows_path = out.with_name(out.name + PARTIAL_SUFFIX)
        self.meta_path = out.with_name(out.name + PARTIAL_SUFFIX + ".json")
        self.next_index, self.stats, self.rng_state = 0, DemoStats(), None
        self._file = None

    def open(self) -> None:
        """Resume from a partial file of the same arguments, or start one (replacing a partial of others)."""
        meta = json.loads(self.meta_path.read_text()) if self.meta_path.is_file() else None
        size = self.rows_path.stat().st_size if self.rows_path.is_file() else -1
        if meta is not None and meta["args"] == self.args and size >= meta["bytes"]:
            os.truncate(self.rows_path, meta["bytes"])
            self.next_index = meta["next_index"]
            self.stats = DemoStats(**meta["stats"])
            version, internal, gauss = meta["rng_state"]
            self.rng_state = (version, tuple(internal), gauss)
            log.info("demos: resuming %s at episode %d of %d (%d rows of earlier episodes kept)", self.out,
                     self.next_index, self.args["num_episodes"], self.stats.rows)
        elif meta is not None or size >= 0:
            log.warning("demos: %s was written with other arguments or is incomplete; starting over", self.rows_path)
        self._file = self.rows_path.open("a" if self.next_index else "w", encoding="utf-8")

    def episode_done(self, text: str, next_index: int, rng: random.Random, elapsed_s: float) -> None:
        self._file.write(text)
        self._file.flush()
        self.next_index = next_index
        self.stats.elapsed_s = elapsed_s
        meta = {"args": self.args, "next_index": next_index, "bytes": self._file.tell(),
                "stats": asdict(self.stats), "rng_state": rng.getstate()}
        write_text_atomic(self.meta_path, json.dumps(meta))

    def finish(self) -> None:
        """The partial file becomes ``out`` (a rename: readers see the old file or the whole new one)."""
        self._file.close()
        self.stats.end_reasons = dict(sorted(self.stats.end_reasons.items()))
        os.chmod(self.rows_path, 0o644)
        os.replace(self.rows_path, self.out)
        self.meta_path.unlink(missing_ok=True)

    def abandon(self) -> None:
        """After an error or a signal: keep finished episodes for a re-run; remove a partial file without any."""
        if self._file is not None:
            self._file.close()
        if self.next_index == 0:
            self.rows_path.unlink(missing_ok=True)
            self.meta_path.unlink(missing_ok=True)
        else:
            log.warning("demos: stopped after %d of %d episodes; their rows are kept in %s and the same command "
                        "resumes from there", self.next_index, self.args["num_episodes"], self.rows_path)


def write_demos(
    cfg: Config,
    out_path: str | os.PathLike,
    num_episodes: int,
    epsilon: float = 0.0,
    seed: int = 0,
    *,
    reasoning: str = "plan",
    tokenizer: Any = None,
) -> DemoStats:
    """Write expert demonstrations of the recipe's environment as chat rows (JSONL), resumably.

    Finished episodes go to ``<out>.partial`` as they complete; at the end it is renamed to ``out``. Stopped
    before (an error, Ctrl-C, SIGTERM from a time limit: ``megatron-gigpo demos`` turns it into an exit), the
    finished episodes stay there and a call with the same arguments resumes after them, writing the same file an
    uninterrupted call writes (:class:`_PartialFile`). A progress line (episodes, rate, time left) goes to the
    log every tenth of the episodes or :data:`PROGRESS_EVERY_S` seconds.

    Args:
        cfg: validated recipe; its environment, prompt settings and ``model.path`` (tokenizer) are used.
        out_path: the JSONL file to write (its folder is created).
        num_episodes: training tasks to play (>= 1; passes repeat when the training list is shorter).
        epsilon: share of steps, in [0, 1], that take a uniformly random admissible action instead.
        seed: seeds the task order, the environment resets and the epsilon draws.
        reasoning: ``plan`` or ``none`` (:data:`REASONING_MODES`).
        tokenizer: the policy's tokenizer; default: loaded from ``cfg.model.path``.

    Returns:
        :class:`DemoStats` (over all episodes, resumed ones included).

    Raises:
        ValueError: a bad argument (named), or training tasks that are validation tasks.
        ConfigError: no expert for ``env.name``.
        DemoError, PromptTooLongError: see :func:`play_episode`.
    """
    from megatron_gigpo.builders import step_prompt_settings
    from megatron_gigpo.envs.registry import env_kwargs
    from megatron_gigpo.envs.registry import make_env
    from megatron_gigpo.episodes.prompts import step_prompt_renderer

    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
    if reasoning not in REASONING_MODES:
        raise ValueError(f"reasoning must be one of {', '.join(REASONING_MODES)}, got {reasoning!r}")
    expert = make_expert(cfg.env.name)
    tasks = demo_tasks(cfg, num_episodes, seed)
    renderer = step_prompt_renderer(cfg.env.name, tokenizer if tokenizer is not None else _load_tokenizer(cfg),
                                    **step_prompt_settings(cfg))
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    args = {"env": cfg.env.name, "num_episodes": num_episodes, "epsilon": epsilon, "seed": seed,
            "reasoning": reasoning, "max_steps": cfg.env.max_steps, "tasks": [t.task_id for t in tasks[:3]],
            "model": cfg.model.path,
            "prompt": repr(sorted(step_prompt_settings(cfg).items()))}
    partial = _PartialFile(out, args)
    env = make_env(cfg.env.name, **env_kwargs(cfg.env), **expert.env_kwargs)
    try:
        partial.open()
        _play_all(partial, env, expert, renderer, tasks, cfg, epsilon=epsilon, seed=seed, reasoning=reasoning)
        partial.finish()
    except BaseException:
        partial.abandon()
        raise
    finally:
        env.close()
    return partial.stats


def _play_all(partial: _PartialFile, env, expert, renderer, tasks: list[Task], cfg: Config, *, epsilon: float,
              seed: int, reasoning: str) -> None:
    """Play ``tasks`` from ``partial.next_index`` on, recording each finished episode in ``partial``."""
    from megatron_gigpo.episodes.collector import reset_seed

    rng, stats = random.Random(seed), partial.stats
    if partial.rng_state is not None:
        rng.setstate(partial.rng_state)
    begun = time.perf_counter()
    start, first, last_line = begun - stats.elapsed_s, partial.next_index, time.monotonic()
    every = max(1, len(tasks) // 10)
    for index in range(partial.next_index, len(tasks)):
        task = tasks[index]
        episode = play_episode(
            env, expert, renderer, task, reset_seed=reset_seed(seed, task, index, 0, False),
            max_steps=cfg.env.max_steps, epsilon=epsilon, rng=rng, reasoning=reasoning,
            prompt_overflow=cfg.rollout.prompt_overflow,
        )
        if not episode.rows:
            stats.skipped += 1
            log.warning("demos: task %s skipped: %s at its first state", task.task_id, episode.end_reason)
        else:
            stats.episodes += 1
            stats.rows += len(episode.rows)
            stats.won += int(episode.won)
            stats.random_steps += episode.random_steps
            stats.truncated_prompts += episode.truncated_prompts
            stats.end_reasons[episode.end_reason] = stats.end_reasons.get(episode.end_reason, 0) + 1
        text = "".join(json.dumps({**row, "episode": index}, ensure_ascii=False) + "\n" for row in episode.rows)
        partial.episode_done(text, index + 1, rng, time.perf_counter() - start)
        done = index + 1
        if done < len(tasks) and (done % every == 0 or time.monotonic() - last_line >= PROGRESS_EVERY_S):
            last_line = time.monotonic()
            rate = (done - first) / max(time.perf_counter() - begun, 1e-9)  # episodes per second, this call
            left_s = (len(tasks) - done) / rate if rate else float("inf")
            left = f"{left_s / 60:.0f} min" if left_s >= 120 else f"{left_s:.0f} s"
            log.info("demos: %d/%d episodes (%d won, %d skipped), %.1f episodes/min, about %s left", done,
                     len(tasks), stats.won, stats.skipped, 60 * rate, left)
