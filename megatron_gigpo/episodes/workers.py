"""Environment workers: Ray actors that each host several environment slots and step them in parallel.

Failure model (issue #5, section 1): an exception raised by one environment ends only that slot's episode
(the worker returns the traceback in :class:`EnvOutcome.error` and rebuilds the environment before its next
reset); a worker process that dies or exceeds ``call_timeout_s`` ends the episodes of every slot it hosted.
Either way the pool reports the failure instead of raising, and the run goes on; a dead worker is replaced
by a fresh actor at the next reset.

Slots are placed round-robin (environment ``i`` on worker ``i % num_workers``), so the members of one group
live on different workers whenever there are several.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from megatron_gigpo.envs.base import Environment, ProjectedAction, ResetResult, StepResult, Task
from megatron_gigpo.envs.registry import ENVIRONMENTS, make_env

EnvFactory = Callable[[], Environment]
logger = logging.getLogger(__name__)


def _make_registered_env(env_name: str, env_kwargs: dict[str, Any]) -> Environment:
    return make_env(env_name, **env_kwargs)


def registry_env_factory(env_name: str, env_kwargs: dict[str, Any]) -> EnvFactory:
    """A picklable factory building ``megatron_gigpo.envs.registry.make_env(env_name, **env_kwargs)``.

    The environment's module (and its optional dependencies) is imported only where the factory is called,
    i.e. in the worker processes.

    Raises:
        KeyError: ``env_name`` is not registered (the message lists the registered names).
    """
    if env_name not in ENVIRONMENTS:
        raise KeyError(f"unknown environment {env_name!r}; registered: {sorted(ENVIRONMENTS)}")
    return functools.partial(_make_registered_env, env_name, dict(env_kwargs))


@dataclass
class EnvOutcome:
    """What one slot's reset or step produced.

    Attributes:
        result: the environment's :class:`ResetResult` / :class:`StepResult`; None on failure.
        projected: for steps, the action the response was projected to; None for resets and failures.
        error: None on success, else a description of the failure (the traceback, or the worker's death).
        worker_died: the failure was the hosting worker's death or time-out, not an exception in the env.
    """

    result: ResetResult | StepResult | None
    projected: ProjectedAction | None = None
    error: str | None = None
    worker_died: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


class EnvWorker:
    """Hosts environment slots in one process; used as a Ray actor by :class:`EnvWorkerPool`.

    Args:
        env_factory: builds one :class:`Environment`; called once per slot, lazily, and again after an
            environment raised.
        worker_index: position of this worker in its pool (for error messages).
    """

    def __init__(self, env_factory: EnvFactory, worker_index: int) -> None:
        self._factory = env_factory
        self._index = worker_index
        self._envs: dict[int, Environment] = {}
        self._admissible: dict[int, list[str] | None] = {}
        self._prepare_failed: set[type[Environment]] = set()

    def pid(self) -> int:
        return os.getpid()

    def _drop(self, slot: int) -> None:
        env = self._envs.pop(slot, None)
        self._admissible.pop(slot, None)
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - the env is already broken; its slot is rebuilt either way
                pass

    def reset(self, requests: Sequence[tuple[int, Task, int]]) -> list[EnvOutcome]:
        """Reset each ``(slot, task, seed)``; builds the slot's environment on first use."""
        outcomes = []
        for slot, task, seed in requests:
            try:
                if slot not in self._envs:
                    self._envs[slot] = self._factory()
                result = self._envs[slot].reset(task, seed)
                self._admissible[slot] = result.admissible_actions
                outcomes.append(EnvOutcome(result=result))
            except Exception:  # noqa: BLE001 - reported per slot, the episode ends as failed
                self._drop(slot)
                outcomes.append(EnvOutcome(result=None, error=_describe(self._index, slot, "reset")))
        return outcomes

    def step(self, requests: Sequence[tuple[int, str]]) -> list[EnvOutcome]:
        """For each ``(slot, response_text)``: project the response to an action and step the environment.

        All projections come first, then each environment class's :meth:`Environment.prepare_steps` sees
        its slots' actions at once (to batch shared work such as retrieval), then the slots step in order.
        """
        outcomes: list[EnvOutcome | None] = [None] * len(requests)
        projected: dict[int, ProjectedAction] = {}
        for i, (slot, response_text) in enumerate(requests):
            try:
                projected[i] = self._envs[slot].project_action(response_text, self._admissible[slot])
            except Exception:  # noqa: BLE001 - reported per slot, the episode ends as failed
                self._drop(slot)
                outcomes[i] = EnvOutcome(result=None, error=_describe(self._index, slot, "step"))
        # A slot listed twice may have been dropped by its second projection (its step then reports that).
        self._prepare_steps(
            [(self._envs[requests[i][0]], p.action) for i, p in projected.items() if requests[i][0] in self._envs]
        )
        for i, p in projected.items():
            slot = requests[i][0]
            try:
                result = self._envs[slot].step(p.action)
                self._admissible[slot] = result.admissible_actions
                outcomes[i] = EnvOutcome(result=result, projected=p)
            except Exception:  # noqa: BLE001 - reported per slot, the episode ends as failed
                self._drop(slot)
                outcomes[i] = EnvOutcome(result=None, error=_describe(self._index, slot, "step"))
        return outcomes  # type: ignore[return-value] - every entry was set above

    def _prepare_steps(self, pending: list[tuple[Environment, str]]) -> None:
        by_class: dict[type[Environment], list[tuple[Environment, str]]] = {}
        for env, action in pending:
            by_class.setdefault(type(env), []).append((env, action))
        for cls, pairs in by_class.items():
            try:
                cls.prepare_steps([env for env, _ in pairs], [action for _, action in pairs])
            except Exception:  # noqa: BLE001 - only a speed-up: each step redoes its work and reports errors
                # Warn once per class (a lasting failure costs the batching, not results); later ones at debug.
                level = logging.DEBUG if cls in self._prepare_failed else logging.WARNING
                self._prepare_failed.add(cls)
                logger.log(level, "worker %d: %s.prepare_steps raised; its slots step one by one",
                           self._index, cls.__name__, exc_info=True)

    def close(self) -> None:
        for slot in list(self._envs):
            self._drop(slot)


def _describe(worker_index: int, slot: int, call: str) -> str:
    return f"environment {call} raised in worker {worker_index}, slot {slot}:\n{traceback.format_exc()}"


class EnvWorkerPool:
    """A fixed number of :class:`EnvWorker` Ray actors addressed by global environment index.

    Args:
        env_factory: picklable callable building one environment (see :func:`registry_env_factory`).
        num_workers: number of worker actors (>= 1).
        num_cpus_per_worker: Ray CPU resource reserved per worker actor (> 0; fractions allowed).
        call_timeout_s: seconds a reset/step call to one worker may take before the worker is killed and
            its episodes fail; None waits forever.

    Requires an initialised Ray (``ray.init``). Call :meth:`close` to stop the actors.
    """

    def __init__(
        self,
        env_factory: EnvFactory,
        num_workers: int,
        *,
        num_cpus_per_worker: float,
        call_timeout_s: float | None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if num_cpus_per_worker <= 0:
            raise ValueError(f"num_cpus_per_worker must be > 0, got {num_cpus_per_worker}")
        if call_timeout_s is not None and call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be > 0 or None, got {call_timeout_s}")
        self._factory = env_factory
        self._actor_cls = ray.remote(EnvWorker).options(num_cpus=num_cpus_per_worker, max_restarts=0)
        self._timeout = call_timeout_s
        self._num_workers = num_workers
        self._workers: list[Any] = [self._spawn(i) for i in range(num_workers)]
        self._alive = [True] * num_workers
        self._closed = False
        #: worker deaths and time-outs seen since the pool started.
        self.worker_failures = 0

    @property
    def num_workers(self) -> int:
        return self._num_workers

    def placement(self, index: int) -> tuple[int, int]:
        """``(worker, slot)`` hosting global environment ``index`` (round-robin)."""
        return index % self.num_workers, index // self.num_workers

    def worker_handle(self, worker: int) -> Any:
        """The Ray actor handle of worker ``worker`` (diagnostics and fault-injection tests)."""
        return self._workers[worker]

    def _spawn(self, worker: int) -> Any:
        return self._actor_cls.remote(self._factory, worker)

    def _replace_dead_workers(self) -> None:
        if self._closed:
            raise RuntimeError("EnvWorkerPool is closed")
        for w, alive in enumerate(self._alive):
            if not alive:
                ray.kill(self._workers[w], no_restart=True)
                self._workers[w] = self._spawn(w)
                self._alive[w] = True

    def reset(self, requests: Sequence[tuple[Task, int]]) -> list[EnvOutcome]:
        """Reset environments ``0 .. len(requests)-1`` with ``(task, seed)``; returns outcomes in order.

        Dead workers are replaced first, so every reset starts on a live pool.
        """
        self._replace_dead_workers()
        by_worker: dict[int, list[tuple[int, tuple[int, Task, int]]]] = {}
        for index, (task, seed) in enumerate(requests):
            w, slot = self.placement(index)
            by_worker.setdefault(w, []).append((index, (slot, task, seed)))
        calls = {w: self._workers[w].reset.remote([r for _, r in items]) for w, items in by_worker.items()}
        outcomes = self._gather(calls, {w: [i for i, _ in items] for w, items in by_worker.items()})
        return [outcomes[i] for i in range(len(requests))]

    def step(self, responses: dict[int, str]) -> dict[int, EnvOutcome]:
        """Project and apply each ``{env index: response text}``; returns ``{env index: outcome}``.

        Environments on a worker already known dead fail at once without a call.
        """
        if self._closed:
            raise RuntimeError("EnvWorkerPool is closed")
        by_worker: dict[int, list[tuple[int, tuple[int, str]]]] = {}
        for index, text in responses.items():
            w, slot = self.placement(index)
            by_worker.setdefault(w, []).append((index, (slot, text)))
        outcomes: dict[int, EnvOutcome] = {}
        calls = {}
        for w, items in by_worker.items():
            if self._alive[w]:
                calls[w] = self._workers[w].step.remote([r for _, r in items])
            else:
                for index, _ in items:
                    outcomes[index] = EnvOutcome(None, error=f"worker {w} is dead", worker_died=True)
        outcomes.update(self._gather(calls, {w: [i for i, _ in by_worker[w]] for w in calls}))
        return outcomes

    def _gather(self, calls: dict[int, Any], indices: dict[int, list[int]]) -> dict[int, EnvOutcome]:
        """Collect per-worker results; a dead or timed-out worker turns into failures of its envs."""
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        outcomes: dict[int, EnvOutcome] = {}
        for w, ref in calls.items():
            try:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                results = ray.get(ref, timeout=timeout)
            except (RayActorError, GetTimeoutError) as exc:
                self._alive[w] = False
                self.worker_failures += 1
                if isinstance(exc, GetTimeoutError):
                    ray.kill(self._workers[w], no_restart=True)
                reason = f"worker {w} failed ({type(exc).__name__}): {exc}"
                for index in indices[w]:
                    outcomes[index] = EnvOutcome(None, error=reason, worker_died=True)
                continue
            for index, outcome in zip(indices[w], results):
                outcomes[index] = outcome
        return outcomes

    def close(self) -> None:
        """Close every environment and stop the actors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for w, worker in enumerate(self._workers):
            if self._alive[w]:
                try:
                    ray.get(worker.close.remote(), timeout=30)
                except (RayActorError, GetTimeoutError):
                    pass
            ray.kill(worker, no_restart=True)
        self._alive = [False] * self._num_workers
