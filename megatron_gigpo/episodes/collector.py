"""The grouped multi-turn episode collector (issue #5; GiGPO paper Sec. 4, Algorithm 1 lines 3-9).

One :meth:`EpisodeCollector.collect` call runs ``B = len(tasks) × group_size`` episodes: every task is a
group whose ``group_size`` members reset with the same task and seed, which must give byte-identical first
observations (checked; GiGPO's episode and step groups are meaningless otherwise). Then, until every
episode is done or ``max_steps`` is reached, the prompts of the still-active episodes are rendered
(:mod:`megatron_gigpo.episodes.prompts`), generated in one batch by the vLLM rollout engines, projected to
actions and stepped in the environment workers (:mod:`megatron_gigpo.episodes.workers`).

Each (trajectory, step) becomes one row of the :class:`TrainingBatch`. Episodes that end by an environment
or worker failure contribute no rows (their return is unknown, so no advantage can be formed); they are
counted in ``episode/failed`` and listed in ``batch.extras["failed_traj_ids"]``.

A step whose prompt cannot fit ``max_prompt_length`` even fully truncated (stage 3 of the policy in
:mod:`megatron_gigpo.episodes.prompts`) is handled by ``prompt_overflow``: ``"error"`` raises
:class:`~megatron_gigpo.episodes.prompts.PromptTooLongError`; ``"end_episode"`` ends only that trajectory
there. Its earlier steps stay rows (rewards unchanged, steps ``0..len-1``), it is done and not won, and the
unpromptable step has no row. At step 0 it has no row at all, so it is a failed episode exactly like an
environment crash (the members of a group share their first prompt, so the whole group fails together).
Both count in ``episode/prompt_overflow_rate``; one warning per :meth:`EpisodeCollector.collect` call names
the trajectories, steps and token counts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from megatron_gigpo.algo.grouping import anchor_key
from megatron_gigpo.envs.base import Anchor, ResetResult, StepResult, Task
from megatron_gigpo.episodes.batch import TrainingBatch
from megatron_gigpo.episodes.metrics import (
    EpisodeSummary,
    episode_metrics,
    no_effect_rate,
    row_metrics,
    step_group_metrics,
)
from megatron_gigpo.episodes.prompts import (
    DEFAULT_PROMPT_STYLE,
    PROMPT_OVERFLOW_POLICIES,
    PromptTemplate,
    PromptTooLongError,
    RenderedPrompt,
    StepPromptState,
    step_prompt_renderer,
)
from megatron_gigpo.episodes.seeds import reset_seed, step_sampling  # re-exported: the collector's seeds
from megatron_gigpo.episodes.workers import EnvFactory, EnvOutcome, EnvWorkerPool, registry_env_factory

if TYPE_CHECKING:
    from megatron_gigpo.rollout.engine import GenerationResult, SamplingConfig
    from megatron_gigpo.rollout.engine_group import RolloutEngineGroup

log = logging.getLogger(__name__)


class GroupResetMismatchError(RuntimeError):
    """Members of one group did not start from byte-identical observations (broken GiGPO grouping)."""


class RolloutStopped(Exception):
    """:meth:`EpisodeCollector.collect` gave up its episodes because its ``stop`` callable said so (a stop
    signal, :mod:`megatron_gigpo.run.preemption`): between two environment steps, no call in flight."""


@dataclass
class _Row:
    step: int
    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: list[float]
    anchor: Anchor
    reward: float
    valid: bool  # format rule of the env's projection: the invalid-action penalty applies when False
    admissible: bool  # the env recognised the action (reported as action/non_admissible_rate, not penalised)
    finish_reason: str
    action: str
    routed_experts: Any = None  # numpy (P + R - 1, layers, top-k) from the engine (routing replay), or None
    engine: int = 0  # index of the engine that sampled the response
    weight_version: int = 0  # the policy version the engine reported for it


@dataclass
class _Episode:
    """Mutable state of one trajectory during collection."""

    index: int
    group: int
    task: Task
    uid: str
    traj_id: str
    prompt: StepPromptState = field(default_factory=StepPromptState)  # what the next prompt is rendered from
    anchor: Anchor = ""
    task_type: str | None = None
    rows: list[_Row] = field(default_factory=list)
    done: bool = False
    won: bool = False
    failure: str | None = None
    overflow: PromptTooLongError | None = None  # set when the episode ended on a prompt that cannot fit
    episode_return: float = 0.0

    @property
    def active(self) -> bool:
        return not self.done and self.failure is None


@dataclass
class _PromptStats:
    rendered: int = 0
    truncated: int = 0
    history_pairs_dropped: int = 0
    observation_tokens_dropped: int = 0

    def add(self, prompt: RenderedPrompt) -> None:
        self.rendered += 1
        self.truncated += int(prompt.truncated)
        self.history_pairs_dropped += prompt.history_pairs_dropped
        self.observation_tokens_dropped += prompt.observation_tokens_dropped

    def metrics(self) -> dict[str, float]:
        return {
            "prompt/rendered": float(self.rendered),
            "prompt/truncated": float(self.truncated),
            "prompt/truncated_frac": self.truncated / self.rendered if self.rendered else 0.0,
            "prompt/history_pairs_dropped": float(self.history_pairs_dropped),
            "prompt/observation_tokens_dropped": float(self.observation_tokens_dropped),
        }


def _end_on_overflow(episode: _Episode, exc: PromptTooLongError) -> None:
    """End a trajectory whose current prompt cannot fit ``max_prompt_length`` (``prompt_overflow=end_episode``).

    With earlier steps it is done and not won; its rows stay (steps ``0..len-1``, rewards unchanged), and the
    step that could not be prompted gets no row. At step 0 there is no row to train on and no return to
    compare, so it fails like an episode whose environment crashed (no rows, listed in ``failed_traj_ids``).
    """
    episode.overflow = exc
    if episode.rows:
        episode.done, episode.won = True, False
    else:
        episode.failure = f"prompt overflow at step 0: {exc}"


def _task_type(task: Task, reset: ResetResult) -> str | None:
    """The task family, from the environment's reset info, else the task payload; None when neither has one."""
    if "task_type" in reset.info:
        return str(reset.info["task_type"])
    if "task_type" in task.payload:
        return str(task.payload["task_type"])
    return None


def _first_difference(a: ResetResult, b: ResetResult) -> str | None:
    """Name and values of the first field in which two resets of one group differ, or None."""
    if a.observation != b.observation:
        return f"observation {a.observation[:200]!r} vs {b.observation[:200]!r}"
    if anchor_key(a.anchor) != anchor_key(b.anchor):
        return "anchor (same observation text, different anchor bytes)"
    if a.task_description != b.task_description:
        return f"task_description {a.task_description!r} vs {b.task_description!r}"
    if a.admissible_actions != b.admissible_actions:
        return f"admissible_actions {a.admissible_actions!r} vs {b.admissible_actions!r}"
    return None


class EpisodeCollector:
    """Collects grouped multi-turn episodes into a :class:`TrainingBatch`.

    Args:
        env_name: environment name in ``megatron_gigpo.envs.registry`` (also selects the prompt template).
        env_kwargs: keyword arguments of ``make_env(env_name, **env_kwargs)``.
        tokenizer: Hugging Face tokenizer of the policy, with a chat template.
        engine_group: the rollout engines; ``generate(prompt_token_ids, sampling) -> list[GenerationResult]``
            in prompt order (``megatron_gigpo.rollout.engine_group.RolloutEngineGroup``).
        group_size: N, rollouts per task (members of one group).
        num_groups: tasks per training batch; :meth:`collect` checks it for training calls.
        max_steps: step limit per episode (the environment may end episodes earlier).
        history_length: K, past (observation, action) pairs shown in each prompt.
        max_prompt_length: prompt token limit (truncation policy in :mod:`~megatron_gigpo.episodes.prompts`).
        sampling: the engines' ``SamplingConfig`` for training collection (one sample per prompt).
        num_workers: environment worker actors.
        seed: base seed of the environment resets (see :func:`reset_seed`).
        num_cpus_per_worker: Ray CPUs reserved per environment worker.
        env_call_timeout_s: deadline in seconds of one environment reset or step (the recipe's
            ``trainer.timeouts.env_call_s``; None: its default); a late call ends that episode as failed, like a
            crash, and the collection goes on (see :mod:`megatron_gigpo.episodes.workers`).
        env_step_latency_s: seconds each environment worker's step call waits (recipe ``env.step_latency_s``).
        env_factory: picklable zero-argument callable building one environment, replacing the registry
            (custom environments); when given, ``env_kwargs`` must be empty.
        prompt_style: the template style of ``env_name`` (recipe ``env.prompt_template``; one of
            :data:`~megatron_gigpo.episodes.templates.PROMPT_STYLES`).
        prompt_template: overrides the registered template of ``env_name`` (and ``prompt_style``).
        chat_template_kwargs: extra ``apply_chat_template`` arguments (e.g. ``{"enable_thinking": False}``).
        prompt_overflow: ``"end_episode"`` or ``"error"`` (:data:`PROMPT_OVERFLOW_POLICIES`): what a step
            whose prompt cannot fit ``max_prompt_length`` does (see the module docstring).

    Raises:
        ValueError: a size < 1, ``env_kwargs`` with ``env_factory``, an unknown ``prompt_overflow``, or
            ``max_prompt_length + sampling.max_tokens`` over the engines' ``max_model_len``.
        KeyError: no template of ``prompt_style`` for ``env_name`` (and no ``prompt_template``).

    Requires an initialised Ray. Call :meth:`close` (or use it as a context manager) to stop the workers.
    """

    def __init__(
        self,
        env_name: str,
        env_kwargs: dict[str, Any],
        tokenizer: Any,
        engine_group: RolloutEngineGroup,
        *,
        group_size: int,
        num_groups: int,
        max_steps: int,
        history_length: int,
        max_prompt_length: int,
        sampling: SamplingConfig,
        num_workers: int,
        seed: int,
        num_cpus_per_worker: float = 1.0,
        env_call_timeout_s: float | None = None,
        env_step_latency_s: float = 0.0,
        env_factory: EnvFactory | None = None,
        prompt_style: str = DEFAULT_PROMPT_STYLE,
        prompt_template: PromptTemplate | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        prompt_overflow: str = "end_episode",
    ) -> None:
        if prompt_overflow not in PROMPT_OVERFLOW_POLICIES:
            raise ValueError(
                f"EpisodeCollector: prompt_overflow={prompt_overflow!r} is not one of "
                f"{', '.join(PROMPT_OVERFLOW_POLICIES)}"
            )
        for name, value in (("group_size", group_size), ("num_groups", num_groups), ("max_steps", max_steps)):
            if value < 1:
                raise ValueError(f"EpisodeCollector: {name} must be >= 1, got {value}")
        if env_factory is not None and env_kwargs:
            raise ValueError(f"EpisodeCollector: env_kwargs {sorted(env_kwargs)} given together with env_factory")
        self._check_lengths(engine_group, max_prompt_length, sampling)
        factory = env_factory if env_factory is not None else registry_env_factory(env_name, env_kwargs)
        self.env_name = env_name
        self.engine_group = engine_group
        self.group_size = group_size
        self.num_groups = num_groups
        self.max_steps = max_steps
        self.sampling = sampling
        self.seed = seed
        self.prompt_overflow = prompt_overflow
        self.renderer = step_prompt_renderer(
            env_name, tokenizer, history_length=history_length, max_prompt_length=max_prompt_length,
            prompt_style=prompt_style, template=prompt_template, chat_template_kwargs=chat_template_kwargs,
        )
        if env_call_timeout_s is None:
            from megatron_gigpo.run.config import TimeoutsConfig

            env_call_timeout_s = TimeoutsConfig().env_call_s
        self.pool = EnvWorkerPool(
            factory, num_workers, num_cpus_per_worker=num_cpus_per_worker, call_timeout_s=env_call_timeout_s,
            step_latency_s=env_step_latency_s,
        )

    @staticmethod
    def _check_lengths(engine_group: RolloutEngineGroup, max_prompt_length: int, sampling: SamplingConfig) -> None:
        """A full prompt plus ``max_tokens`` must fit the engines' context (else vLLM rejects it mid-run)."""
        max_model_len = engine_group.config.max_model_len
        if max_prompt_length + sampling.max_tokens > max_model_len:
            raise ValueError(
                f"EpisodeCollector: max_prompt_length={max_prompt_length} + sampling.max_tokens="
                f"{sampling.max_tokens} exceeds the rollout engines' max_model_len={max_model_len}"
            )

    def __enter__(self) -> "EpisodeCollector":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the environment workers."""
        self.pool.close()

    def collect(
        self,
        tasks: Sequence[Task],
        iteration: int,
        *,
        validation: bool = False,
        group_size: int | None = None,
        sampling: SamplingConfig | None = None,
        round_index: int = 0,
        stop: Callable[[], object] | None = None,
    ) -> tuple[TrainingBatch, dict[str, float]]:
        """Run one batch of grouped episodes.

        Args:
            tasks: one task per group, in group order. Training calls need ``len(tasks) == num_groups``;
                validation calls take any number (the driver passes the fixed validation list, whole or in
                chunks).
            iteration: training iteration (part of the uids and of the training reset seeds).
            validation: use validation seeds (task-only, see :func:`reset_seed`) and ``val-`` uids.
            group_size: overrides N for this call (validation often uses 1).
            sampling: overrides the sampling config for this call (e.g. greedy validation).
            round_index: generation round within the iteration (dynamic sampling collects several batches per
                training iteration); part of the training uids (``it<i>-r<k>-g<g>`` for k > 0, ``it<i>-g<g>``
                for round 0), reset seeds and sampling seeds, so each round draws fresh episodes.
            stop: asked before each step (a generation batch and an environment step); a true answer abandons
                the episodes (:class:`RolloutStopped`).

        Returns:
            ``(batch, metrics)``: the rows of every non-failed (trajectory, step), ordered by trajectory then
            step; and the scalar metrics (``episode/*``, ``action/*``, ``step_group/*``, ``prompt/*``,
            ``response/*``, ``workers/*``, ``timing/*`` in seconds). ``batch.extras`` holds ``env_name``,
            ``iteration``, ``validation``, ``group_size``, ``num_groups``, ``actions`` (the executed action
            of every row), ``failed_traj_ids``, ``failures`` (traj id -> error text) and ``episodes`` (one
            :class:`~megatron_gigpo.episodes.metrics.EpisodeSummary` per trajectory, failed ones included).

        Raises:
            ValueError: wrong number of tasks, or a task of another environment.
            GroupResetMismatchError: the members of a group reset to different observations.
            PromptTooLongError: a prompt cannot fit ``max_prompt_length`` even fully truncated, with
                ``prompt_overflow="error"`` (with ``"end_episode"`` that trajectory ends instead).
            RolloutStopped: ``stop()`` was true before a step.
        """
        n = self.group_size if group_size is None else group_size
        if n < 1:
            raise ValueError(f"collect: group_size must be >= 1, got {n}")
        if round_index < 0 or (validation and round_index):
            raise ValueError(f"collect: round_index must be >= 0 and 0 for validation, got {round_index}")
        if sampling is not None:
            self._check_lengths(self.engine_group, self.renderer.max_prompt_length, sampling)
        if not validation and len(tasks) != self.num_groups:
            raise ValueError(f"collect: got {len(tasks)} tasks for a training batch of num_groups={self.num_groups}")
        if not tasks:
            raise ValueError("collect: empty task list")
        for task in tasks:
            if task.env != self.env_name:
                raise ValueError(f"collect: task {task.task_id!r} is for env {task.env!r}, not {self.env_name!r}")
        failures_before, timeouts_before = self.pool.worker_failures, self.pool.env_timeouts
        timing = {"timing/reset_s": 0.0, "timing/render_s": 0.0, "timing/generate_s": 0.0, "timing/env_step_s": 0.0}
        start = time.perf_counter()
        episodes = self._reset(tasks, n, iteration, validation, round_index)
        timing["timing/reset_s"] = time.perf_counter() - start
        stats = _PromptStats()
        overflows: list[_Episode] = []
        base_sampling = sampling if sampling is not None else self.sampling
        for step in range(self.max_steps):
            active = [e for e in episodes if e.active]
            if not active:
                break
            if stop is not None and (why := stop()):
                raise RolloutStopped(f"rollout stopped before its step {step + 1} ({why})")
            self._step(active, step_sampling(base_sampling, iteration, step, validation, round_index), stats, timing,
                       overflows)
        self._warn_overflows(overflows, len(episodes))
        batch, finish_reasons = self._build_batch(episodes, iteration, n, validation)
        summaries = [self._summary(e) for e in episodes]
        batch.extras["episodes"] = summaries
        metrics = episode_metrics(self.env_name, summaries)
        metrics.update(
            row_metrics(
                batch.action_valid.tolist(),
                [int(p.numel()) for p in batch.prompt_ids],
                batch.response_lengths().tolist(),
                finish_reasons,
                action_admissible=batch.extras["action_admissible"],
            )
        )
        metrics.update(step_group_metrics(batch.uid, batch.anchor))
        metrics.update(no_effect_rate(batch.traj_id, batch.step_index.tolist(), batch.anchor))
        metrics.update(stats.metrics())
        metrics["workers/failures"] = float(self.pool.worker_failures - failures_before)
        metrics["workers/env_timeouts"] = float(self.pool.env_timeouts - timeouts_before)
        metrics.update(timing)
        metrics["timing/collect_s"] = time.perf_counter() - start
        return batch, metrics

    def _reset(
        self, tasks: Sequence[Task], n: int, iteration: int, validation: bool, round_index: int
    ) -> list[_Episode]:
        """Build the B episodes, reset them in the workers and check every group's members agree."""
        episodes, requests = [], []
        rnd = f"-r{round_index}" if round_index else ""
        for g, task in enumerate(tasks):
            uid = f"val-g{g}" if validation else f"it{iteration}{rnd}-g{g}"
            seed = reset_seed(self.seed, task, g, iteration, validation, round_index)
            for j in range(n):
                episodes.append(_Episode(index=len(episodes), group=g, task=task, uid=uid, traj_id=f"{uid}-n{j}"))
                requests.append((task, seed))
        outcomes = self.pool.reset(requests)
        for episode, outcome in zip(episodes, outcomes):
            if not outcome.ok:
                episode.failure = outcome.error
                log.warning("episode %s failed at reset: %s", episode.traj_id, outcome.error)
                continue
            result = outcome.result
            assert isinstance(result, ResetResult), type(result)
            episode.prompt, episode.anchor = StepPromptState.from_reset(result), result.anchor
            episode.task_type = _task_type(episode.task, result)
        for g, task in enumerate(tasks):
            members = [(e, outcomes[e.index].result) for e in episodes[g * n : (g + 1) * n] if e.failure is None]
            for e, result in members[1:]:
                diff = _first_difference(members[0][1], result)
                if diff is not None:
                    raise GroupResetMismatchError(
                        f"group {g} (task {task.task_id!r}, seed {requests[e.index][1]}): member "
                        f"{members[0][0].traj_id} and member {e.traj_id} reset to different states: {diff}"
                    )
        return episodes

    def _step(
        self,
        active: list[_Episode],
        sampling: SamplingConfig,
        stats: _PromptStats,
        timing: dict,
        overflows: list[_Episode],
    ) -> None:
        """One synchronous step of every active episode: render, generate, project and step.

        Episodes whose prompt cannot fit end before generation and are appended to ``overflows``.
        """
        t0 = time.perf_counter()
        rendered = self._render(active, stats, overflows)
        t1 = time.perf_counter()
        timing["timing/render_s"] += t1 - t0
        if not rendered:
            return
        active, prompts = [e for e, _ in rendered], [p for _, p in rendered]
        generations: list[GenerationResult] = self.engine_group.generate([p.token_ids for p in prompts], sampling)
        t2 = time.perf_counter()
        if len(generations) != len(prompts):
            raise RuntimeError(f"rollout engines returned {len(generations)} results for {len(prompts)} prompts")
        for g in generations:
            if len(g.log_probs) != len(g.response_ids):
                raise RuntimeError(
                    f"a generation has {len(g.log_probs)} log-probs for {len(g.response_ids)} tokens; the "
                    "collector needs rollout log-probs (SamplingConfig.logprobs=True)"
                )
        outcomes = self.pool.step({e.index: g.text for e, g in zip(active, generations)})
        timing["timing/generate_s"] += t2 - t1
        timing["timing/env_step_s"] += time.perf_counter() - t2
        for episode, prompt, generation in zip(active, prompts, generations):
            self._apply_step(episode, prompt, generation, outcomes[episode.index])

    def _render(
        self, active: list[_Episode], stats: _PromptStats, overflows: list[_Episode]
    ) -> list[tuple[_Episode, RenderedPrompt]]:
        """The current prompt of each active episode; one that cannot fit ends (``end_episode``) or raises."""
        rendered = []
        for episode in active:
            try:
                prompt = episode.prompt.render(self.renderer)
            except PromptTooLongError as exc:
                if self.prompt_overflow == "error":
                    raise
                _end_on_overflow(episode, exc)
                overflows.append(episode)
                continue
            stats.add(prompt)
            rendered.append((episode, prompt))
        return rendered

    def _warn_overflows(self, overflows: list[_Episode], num_episodes: int) -> None:
        """One warning per collection naming the episodes ended by a prompt overflow (at most 5 listed)."""
        if not overflows:
            return
        shown = "; ".join(
            f"{e.traj_id} at step {e.overflow.step}: {e.overflow.prompt_tokens} tokens, "
            f"{e.overflow.num_admissible_actions} admissible actions"
            for e in overflows[:5]
            if e.overflow is not None
        )
        more = f"; and {len(overflows) - 5} more" if len(overflows) > 5 else ""
        log.warning(
            "prompt overflow (env %r): %d of %d episodes ended because their prompt with no history and an empty "
            "observation exceeds max_prompt_length=%d: %s%s. Their earlier steps stay training rows (at step 0 the "
            "episode fails); raise max_prompt_length (recipe: rollout.prompt_length) to keep them",
            self.env_name, len(overflows), num_episodes, self.renderer.max_prompt_length, shown, more,
        )

    @staticmethod
    def _apply_step(
        episode: _Episode, prompt: RenderedPrompt, generation: GenerationResult, outcome: EnvOutcome
    ) -> None:
        """Record the row of a completed step and advance the episode; a failed step ends the episode."""
        if not outcome.ok:
            episode.failure = outcome.error
            log.warning("episode %s failed at step %d: %s", episode.traj_id, len(episode.rows), outcome.error)
            return
        result, projected = outcome.result, outcome.projected
        assert isinstance(result, StepResult) and projected is not None, (type(result), projected)
        episode.rows.append(
            _Row(
                step=len(episode.rows),
                prompt_ids=prompt.token_ids,
                response_ids=list(generation.response_ids),
                log_probs=[float(x) for x in generation.log_probs],
                anchor=episode.anchor,
                reward=float(result.reward),
                # Penalised iff the response broke the format (the projection's verdict, as in verl-agent); a
                # well-formed but non-admissible action was executed ("Nothing happens.") and is only counted.
                valid=bool(projected.valid),
                admissible=bool(result.action_valid),
                finish_reason=str(generation.finish_reason),
                action=projected.action,
                routed_experts=generation.routed_experts,
                engine=int(generation.engine),
                weight_version=int(generation.weight_version),
            )
        )
        episode.prompt.advance(projected.action, result)
        episode.episode_return += float(result.reward)
        episode.anchor = result.anchor
        episode.done, episode.won = bool(result.done), bool(result.won)

    def _build_batch(
        self, episodes: list[_Episode], iteration: int, n: int, validation: bool
    ) -> tuple[TrainingBatch, list[str]]:
        kept = [(e, r) for e in episodes if e.failure is None for r in e.rows]
        batch = TrainingBatch(
            prompt_ids=[torch.tensor(r.prompt_ids, dtype=torch.int64) for _, r in kept],
            response_ids=[torch.tensor(r.response_ids, dtype=torch.int64) for _, r in kept],
            rollout_log_probs=[torch.tensor(r.log_probs, dtype=torch.float32) for _, r in kept],
            uid=[e.uid for e, _ in kept],
            traj_id=[e.traj_id for e, _ in kept],
            step_index=torch.tensor([r.step for _, r in kept], dtype=torch.int64),
            anchor=[r.anchor for _, r in kept],
            env_reward=torch.tensor([r.reward for _, r in kept], dtype=torch.float64),
            action_valid=torch.tensor([r.valid for _, r in kept], dtype=torch.bool),
            extras={
                "env_name": self.env_name,
                "iteration": iteration,
                "validation": validation,
                "group_size": n,
                "num_groups": len(episodes) // n,
                "actions": [r.action for _, r in kept],
                "action_admissible": [r.admissible for _, r in kept],
                "engine": [r.engine for _, r in kept],
                "weight_version": [r.weight_version for _, r in kept],
                "failed_traj_ids": [e.traj_id for e in episodes if e.failure is not None],
                "failures": {e.traj_id: e.failure for e in episodes if e.failure is not None},
                **self._routed_experts(kept),
            },
        )
        return batch, [r.finish_reason for _, r in kept]

    @staticmethod
    def _routed_experts(kept: list[tuple[_Episode, _Row]]) -> dict[str, list[torch.Tensor]]:
        """``{"routed_experts": per row (P + R - 1, layers, top-k)}`` if the engines returned them, else empty."""
        if not kept or any(r.routed_experts is None for _, r in kept):
            return {}
        return {"routed_experts": [torch.from_numpy(r.routed_experts) for _, r in kept]}

    def _summary(self, e: _Episode) -> EpisodeSummary:
        return EpisodeSummary(
            traj_id=e.traj_id,
            uid=e.uid,
            task_id=e.task.task_id,
            task_type=e.task_type,
            length=len(e.rows),
            won=e.won,
            episode_return=e.episode_return,
            failed=e.failure is not None,
            hit_step_limit=e.failure is None and not e.done,
            prompt_overflow=e.overflow is not None,
        )
