"""Environment workers: Ray actors that each host several environment slots and step them in parallel.

Failure model (issue #5, section 1; deadlines: issue #12): an exception raised by one environment ends only
that slot's episode (the worker returns the traceback in :class:`EnvOutcome.error` and rebuilds the environment
before its next reset). So does an environment reset or step that does not return within ``call_timeout_s``:
the worker runs each environment call on a helper thread and stops waiting at the deadline, abandons that
environment (its thread may still be running) and answers for its other slots; the pool replaces that worker
process at the next reset, which ends the stray thread. A worker process that dies, or that does not answer at
all (e.g. an environment holding the interpreter lock), ends the episodes of every slot it hosted: the pool
waits ``call_timeout_s`` per slot of the call plus a margin, then kills it. Either way the pool reports the
failure instead of raising, and the run goes on; a dead worker is replaced by a fresh actor at the next reset.

Slots are placed round-robin (environment ``i`` on worker ``i % num_workers``), so the members of one group
live on different workers whenever there are several.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from megatron_gigpo.deadlines import describe_actor
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
        error: None on success, else a description of the failure (the traceback, the missed deadline, or the
            worker's death).
        worker_died: the failure was the hosting worker's death or time-out, not an exception in the env.
        timed_out: the environment's own call passed its deadline (the worker survived).
    """

    result: ResetResult | StepResult | None
    projected: ProjectedAction | None = None
    error: str | None = None
    worker_died: bool = False
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


class EnvCallTimeout(TimeoutError):
    """An environment call did not return within its deadline (raised inside the worker, reported per slot)."""


def call_with_deadline(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` on a daemon thread; its result or exception, or :class:`EnvCallTimeout` after ``timeout_s``.

    A call that passes the deadline keeps running on its thread (Python threads cannot be stopped); the caller
    must abandon whatever it was using.
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread, traceback kept
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name="env-call", daemon=True).start()
    if not done.wait(timeout_s):
        raise EnvCallTimeout(f"did not return within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class EnvWorker:
    """Hosts environment slots in one process; used as a Ray actor by :class:`EnvWorkerPool`.

    Args:
        env_factory: builds one :class:`Environment`; called once per slot, lazily, and again after an
            environment raised.
        worker_index: position of this worker in its pool (for error messages).
        call_timeout_s: deadline of one environment call (building + reset, prepare_steps, step) in seconds;
            a late call ends its slot's episode as failed. None: the recipe's default ``trainer.timeouts.env_call_s``.
        step_latency_s: seconds each :meth:`step` call sleeps before returning (recipe ``env.step_latency_s``;
            a simulated remote environment). Not part of any environment call's deadline.
    """

    def __init__(self, env_factory: EnvFactory, worker_index: int, call_timeout_s: float | None = None,
                 step_latency_s: float = 0.0) -> None:
        from megatron_gigpo.run.config import TimeoutsConfig

        self._factory = env_factory
        self._index = worker_index
        self._timeout = TimeoutsConfig().env_call_s if call_timeout_s is None else call_timeout_s
        self._step_latency = step_latency_s
        self._envs: dict[int, Environment] = {}
        self._admissible: dict[int, list[str] | None] = {}
        self._prepare_failed: set[type[Environment]] = set()
        self._node = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self._abandoned_now: dict[int, EnvOutcome] = {}  # slots whose prepare_steps passed the deadline

    def pid(self) -> int:
        return os.getpid()

    def _call(self, fn: Callable[[], Any]) -> Any:
        return call_with_deadline(fn, self._timeout)

    def _late(self, slot: int, call: str, started: float) -> EnvOutcome:
        """Abandon ``slot`` after a missed deadline (its environment is still in use by the late thread)."""
        self._envs.pop(slot, None)
        self._admissible.pop(slot, None)
        error = (f"environment {call} did not return within its deadline of {self._timeout:g} s "
                 f"(waited {time.monotonic() - started:.1f} s) in worker {self._index}, slot {slot}, on node "
                 f"{self._node} (pid {os.getpid()}); the episode ends as failed")
        logger.warning("%s", error)
        return EnvOutcome(result=None, error=error, timed_out=True)

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
            started = time.monotonic()
            try:
                env = self._envs.get(slot)
                if env is None:
                    env, result = self._call(functools.partial(_build_and_reset, self._factory, task, seed))
                    self._envs[slot] = env
                else:
                    result = self._call(functools.partial(env.reset, task, seed))
                self._admissible[slot] = result.admissible_actions
                outcomes.append(EnvOutcome(result=result))
            except EnvCallTimeout:
                outcomes.append(self._late(slot, "reset", started))
            except Exception:  # noqa: BLE001 - reported per slot, the episode ends as failed
                self._drop(slot)
                outcomes.append(EnvOutcome(result=None, error=_describe(self._index, slot, "reset")))
        return outcomes

    def step(self, requests: Sequence[tuple[int, str]]) -> list[EnvOutcome]:
        """For each ``(slot, response_text)``: project the response to an action and step the environment.

        All projections come first, then each environment class's :meth:`Environment.prepare_steps` sees
        its slots' actions at once (to batch shared work such as retrieval), then the slots step in order; then the
        call waits ``step_latency_s``.
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
            [(requests[i][0], p.action) for i, p in projected.items() if requests[i][0] in self._envs]
        )
        for i, p in projected.items():
            slot = requests[i][0]
            if slot not in self._envs and slot in self._abandoned_now:
                outcomes[i] = self._abandoned_now[slot]
                continue
            started = time.monotonic()
            try:
                result = self._call(functools.partial(self._envs[slot].step, p.action))
                self._admissible[slot] = result.admissible_actions
                outcomes[i] = EnvOutcome(result=result, projected=p)
            except EnvCallTimeout:
                outcomes[i] = self._late(slot, "step", started)
            except Exception:  # noqa: BLE001 - reported per slot, the episode ends as failed
                self._drop(slot)
                outcomes[i] = EnvOutcome(result=None, error=_describe(self._index, slot, "step"))
        if self._step_latency > 0:  # once per call: the pool's workers wait in parallel
            time.sleep(self._step_latency)
        return outcomes  # type: ignore[return-value] - every entry was set above

    def _prepare_steps(self, pending: list[tuple[int, str]]) -> None:
        """Each environment class's batched ``prepare_steps``; one that passes the deadline fails its slots
        (their environments are still in use by the late call), recorded in ``self._abandoned_now``."""
        self._abandoned_now = {}
        by_class: dict[type[Environment], list[tuple[int, str]]] = {}
        for slot, action in pending:
            by_class.setdefault(type(self._envs[slot]), []).append((slot, action))
        for cls, pairs in by_class.items():
            started = time.monotonic()
            envs, actions = [self._envs[slot] for slot, _ in pairs], [action for _, action in pairs]
            try:
                self._call(functools.partial(cls.prepare_steps, envs, actions))
            except EnvCallTimeout:
                for slot, _ in pairs:
                    self._abandoned_now[slot] = self._late(slot, f"{cls.__name__}.prepare_steps", started)
            except Exception:  # noqa: BLE001 - only a speed-up: each step redoes its work and reports errors
                # Warn once per class (a lasting failure costs the batching, not results); later ones at debug.
                level = logging.DEBUG if cls in self._prepare_failed else logging.WARNING
                self._prepare_failed.add(cls)
                logger.log(level, "worker %d: %s.prepare_steps raised; its slots step one by one",
                           self._index, cls.__name__, exc_info=True)

    def close(self) -> None:
        for slot in list(self._envs):
            self._drop(slot)


def _build_and_reset(factory: EnvFactory, task: Task, seed: int) -> tuple[Environment, ResetResult]:
    env = factory()
    return env, env.reset(task, seed)


def _describe(worker_index: int, slot: int, call: str) -> str:
    return f"environment {call} raised in worker {worker_index}, slot {slot}:\n{traceback.format_exc()}"


class EnvWorkerPool:
    """A fixed number of :class:`EnvWorker` Ray actors addressed by global environment index.

    Args:
        env_factory: picklable callable building one environment (see :func:`registry_env_factory`).
        num_workers: number of worker actors (>= 1).
        num_cpus_per_worker: Ray CPU resource reserved per worker actor (> 0; fractions allowed).
        call_timeout_s: deadline in seconds of one environment call (a slot's reset or step): a late call ends
            that episode as failed. A worker that does not answer within ``call_timeout_s`` per slot of the call
            plus ``WORKER_GRACE_S`` (and ``step_latency_s`` for a step) is killed and the episodes of all its slots
            fail.
        step_latency_s: seconds each worker's step call waits before returning (:class:`EnvWorker`; >= 0).

    Requires an initialised Ray (``ray.init``). Call :meth:`close` to stop the actors.
    """

    WORKER_GRACE_S = 30.0

    def __init__(
        self,
        env_factory: EnvFactory,
        num_workers: int,
        *,
        num_cpus_per_worker: float,
        call_timeout_s: float,
        step_latency_s: float = 0.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if num_cpus_per_worker <= 0:
            raise ValueError(f"num_cpus_per_worker must be > 0, got {num_cpus_per_worker}")
        if call_timeout_s is None or not 0 < call_timeout_s < float("inf"):
            raise ValueError(f"call_timeout_s must be a positive, finite number of seconds, got {call_timeout_s}")
        if not 0 <= step_latency_s < float("inf"):
            raise ValueError(f"step_latency_s must be a finite number of seconds >= 0, got {step_latency_s}")
        self._factory = env_factory
        self._actor_cls = ray.remote(EnvWorker).options(num_cpus=num_cpus_per_worker, max_restarts=0)
        self._timeout = call_timeout_s
        self._step_latency = step_latency_s
        self._num_workers = num_workers
        self._workers: list[Any] = [self._spawn(i) for i in range(num_workers)]
        self._alive = [True] * num_workers
        self._stale = [False] * num_workers  # an environment call of it passed its deadline: replace at reset
        self._closed = False
        #: worker deaths and time-outs seen since the pool started.
        self.worker_failures = 0
        #: environment calls that passed their deadline (each ended one episode) since the pool started.
        self.env_timeouts = 0

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
        return self._actor_cls.remote(self._factory, worker, self._timeout, self._step_latency)

    def _replace_dead_workers(self) -> None:
        if self._closed:
            raise RuntimeError("EnvWorkerPool is closed")
        for w, alive in enumerate(self._alive):
            if not alive or self._stale[w]:  # a stale worker may still run a late environment call's thread
                ray.kill(self._workers[w], no_restart=True)
                self._workers[w] = self._spawn(w)
                self._alive[w], self._stale[w] = True, False

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
        outcomes.update(self._gather(calls, {w: [i for i, _ in by_worker[w]] for w in calls}, self._step_latency))
        return outcomes

    def _gather(self, calls: dict[int, Any], indices: dict[int, list[int]],
                extra_s: float = 0.0) -> dict[int, EnvOutcome]:
        """Collect per-worker results; a dead or unresponsive worker turns into failures of its envs.

        A worker's own per-call deadlines bound its answer to ``call_timeout_s`` per slot (plus one batched
        ``prepare_steps``) plus ``extra_s`` (a step's latency); past that and ``WORKER_GRACE_S`` it is killed.
        """
        start = time.monotonic()
        outcomes: dict[int, EnvOutcome] = {}
        for w, ref in calls.items():
            limit = self._timeout * (len(indices[w]) + 1) + self.WORKER_GRACE_S + extra_s
            try:
                results = ray.get(ref, timeout=max(0.0, start + limit - time.monotonic()))
            except (RayActorError, GetTimeoutError) as exc:
                self._alive[w] = False
                self.worker_failures += 1
                if isinstance(exc, GetTimeoutError):
                    where = describe_actor(self._workers[w])
                    ray.kill(self._workers[w], no_restart=True)
                    reason = (f"worker {w} ({where}) did not answer within {limit:g} s "
                              f"({len(indices[w])} slots x call_timeout_s={self._timeout:g} s + margin); killed")
                else:
                    reason = f"worker {w} failed ({type(exc).__name__}): {exc}"
                logger.warning("%s", reason.splitlines()[0])
                for index in indices[w]:
                    outcomes[index] = EnvOutcome(None, error=reason, worker_died=True)
                continue
            for index, outcome in zip(indices[w], results):
                outcomes[index] = outcome
                if outcome.timed_out:
                    self._stale[w] = True
                    self.env_timeouts += 1
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
