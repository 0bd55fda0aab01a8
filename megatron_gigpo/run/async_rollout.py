"""Asynchronous rollout with bounded staleness (issue #41 item 4; docs/async-rollout-design.md, D1-D4, D7).

A :class:`RolloutProducer` thread beside the driver collects the training batches ("items") of iterations
``start, start + 1, ...`` while the actor trains on earlier ones. Item ``j`` is exactly what the synchronous
``RunContext.collect_train_batch(j)`` returns (one collector round, or several with dynamic sampling); it
carries the task cursor after its tasks (``cursor_after``), so that a checkpoint stores the cursor of the last
*consumed* item, never the producer's.

Two rules keep the batches usable:

- **the gate** (a ``threading.Condition``): every collector round runs inside :meth:`RolloutProducer.gate`,
  which waits while the driver holds :meth:`RolloutProducer.pause` and marks the round in flight; ``pause()``
  waits until no round is in flight (it drains, never aborts). The driver syncs the weights inside the pause,
  so a round, hence every episode group, is sampled by one policy version. Outside ``pause()`` only the
  producer touches the collector; inside it only the driver (validation);
- **admission**: item ``j`` starts only when the served version ``v`` (the last one :meth:`RolloutProducer.
  publish` announced inside a pause) satisfies ``v >= j - k``, ``k = rollout.asynchronous.max_staleness``; so
  at most ``k + 1`` items are queued or in flight. :func:`check_groups` checks the outcome on every batch the
  driver trains on.

Versions: the actor consuming iteration ``j`` (0-based) is at policy version ``j``; the sync after it pushes
version ``j + 1``. A group's staleness at iteration ``j`` is ``j - v``, ``v`` the ``weight_version`` its rows
report (:mod:`megatron_gigpo.episodes.collector`).

No wait here is unbounded: the driver's waits (:meth:`~RolloutProducer.take`, :meth:`~RolloutProducer.pause`)
have deadlines (:class:`~megatron_gigpo.deadlines.DeadlineError` naming the item or round waited for) and stop
when the producer failed or stopped; the producer's waits (admission, the paused gate) check its stop callable
and :meth:`~RolloutProducer.stop` every :data:`POLL_S` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_gigpo.deadlines import DeadlineError
from megatron_gigpo.episodes.collector import RolloutStopped

if TYPE_CHECKING:
    from megatron_gigpo.episodes.batch import TrainingBatch

__all__ = ["AsyncRolloutError", "POLL_S", "RolloutItem", "RolloutProducer", "check_groups"]

log = logging.getLogger(__name__)

#: Seconds between two checks of a stop request while a wait has nothing to wake it (the stop callable polls).
POLL_S = 0.05


class AsyncRolloutError(RuntimeError):
    """Asynchronous rollout broke one of its rules: a group of two policy versions, a group staler than
    ``rollout.asynchronous.max_staleness``, an item out of order, or a failed producer (chained)."""


@dataclass
class RolloutItem:
    """The training batch of one iteration, as the producer collected it.

    Attributes:
        iteration: 0-based iteration it is for (its uids and seeds are those of sync mode's iteration).
        batch: its rows (``extras["weight_version"]`` per row).
        metrics: its rollout metrics (``collect_train_batch``'s).
        cursor_after: the task cursor after its tasks (the next item's first position).
    """

    iteration: int
    batch: TrainingBatch
    metrics: dict[str, float]
    cursor_after: int


#: ``collect_item(iteration, cursor, producer) -> (batch, metrics, cursor_after)``: the item of 0-based
#: ``iteration`` from task position ``cursor``; each of its collector rounds runs inside ``producer.gate()`` and
#: passes ``producer.stopped`` as the collector's ``stop``.
CollectItem = Callable[[int, int, "RolloutProducer"], "tuple[TrainingBatch, dict[str, float], int]"]


class RolloutProducer:
    """The producer thread, its gate and its item queue (module doc). Started by the constructor.

    Args:
        collect_item: see :data:`CollectItem`.
        start_iteration: first item's 0-based iteration (the resumed iteration; also the served version now).
        task_cursor: task position of the first item.
        max_staleness: k >= 1.
        end_iteration: items ``start_iteration .. end_iteration - 1`` are produced.
        round_timeout_s: the most one round may take (``pause()``'s drain deadline), seconds.
        item_timeout_s: the most ``take()`` waits for its item, seconds.
        stop: the run's stop request (``preemption.requested``): a true answer ends the producer at its next
            wait or step, its item dropped.
    Raises:
        ValueError: ``max_staleness < 1`` or ``end_iteration < start_iteration``.
    """

    def __init__(self, collect_item: CollectItem, *, start_iteration: int, task_cursor: int, max_staleness: int,
                 end_iteration: int, round_timeout_s: float, item_timeout_s: float,
                 stop: Callable[[], object] = lambda: None) -> None:
        if max_staleness < 1 or end_iteration < start_iteration:
            raise ValueError(f"RolloutProducer: max_staleness={max_staleness} must be >= 1 and end_iteration="
                             f"{end_iteration} >= start_iteration={start_iteration}")
        self._collect, self._k, self._end = collect_item, max_staleness, end_iteration
        self._round_timeout_s, self._item_timeout_s, self._stop_request = round_timeout_s, item_timeout_s, stop
        self._cond = threading.Condition()
        self._served = start_iteration  # the policy version the engines serve (published in pause())
        self._items: deque[RolloutItem] = deque()
        self._current: int | None = None  # the item being collected
        self._paused = self._in_flight = self._stopping = False
        self._round_since = 0.0  # monotonic start of the round in flight
        self._error: tuple[int, BaseException] | None = None
        self._waits = {"actor_wait_s": 0.0, "drain_wait_s": 0.0, "engine_wait_s": 0.0}
        self._parked_since: float | None = None  # the producer waits at admission or at the paused gate
        self._thread = threading.Thread(target=self._run, args=(start_iteration, task_cursor),
                                        name="rollout-producer", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- producer thread
    @property
    def served_version(self) -> int:
        """The policy version last published (the engines' weights)."""
        with self._cond:
            return self._served

    def queued(self) -> list[int]:
        """The 0-based iterations of the items ready for :meth:`take`, in order."""
        with self._cond:
            return [item.iteration for item in self._items]

    def stopped(self) -> str | None:
        """Why the producer must stop (the run's stop signal, or :meth:`stop`), or None: the collector's ``stop``."""
        why = self._stop_request()
        return str(why) if why else ("rollout producer stopped" if self._stopping else None)

    def _run(self, iteration: int, cursor: int) -> None:
        try:
            while iteration < self._end and self._admit(iteration):
                with self._cond:
                    self._current = iteration
                batch, metrics, cursor_after = self._collect(iteration, cursor, self)
                with self._cond:
                    self._items.append(RolloutItem(iteration, batch, metrics, cursor_after))
                    self._current = None
                    self._cond.notify_all()
                iteration, cursor = iteration + 1, cursor_after
        except RolloutStopped:
            if not self.stopped():  # only the producer's own stop callable raises it
                self._fail(iteration, AsyncRolloutError("the collector stopped without a stop request"))
        except BaseException as exc:  # noqa: BLE001 - handed to the driver's next take() / pause()
            self._fail(iteration, exc)

    def _fail(self, iteration: int, exc: BaseException) -> None:
        with self._cond:
            self._error = (iteration, exc)
            self._cond.notify_all()

    def _park(self, parked: bool) -> None:
        """Start or end a stretch of the producer waiting for the driver (``async/engine_wait_s``); lock held."""
        now = time.monotonic()
        if self._parked_since is not None:
            self._waits["engine_wait_s"] += now - self._parked_since
        self._parked_since = now if parked else None

    def _admit(self, iteration: int) -> bool:
        """Wait until item ``iteration`` may start (served version >= iteration - k); False when stopped."""
        with self._cond:
            try:
                while self._served < iteration - self._k:
                    if self.stopped():
                        return False
                    self._park(True)
                    self._cond.wait(POLL_S)
            finally:
                self._park(False)
            return not self.stopped()

    @contextlib.contextmanager
    def gate(self) -> Iterator[int]:
        """One collector round: waits while the driver holds :meth:`pause`, then marks the round in flight until
        it ends. Yields the served version at the round's start.

        Raises:
            RolloutStopped: the producer was stopped while it waited.
        """
        with self._cond:
            try:
                while self._paused:
                    if why := self.stopped():
                        raise RolloutStopped(f"rollout stopped at the paused gate ({why})")
                    self._park(True)
                    self._cond.wait(POLL_S)
            finally:
                self._park(False)
            self._in_flight, self._round_since = True, time.monotonic()
            version = self._served
        try:
            yield version
        finally:
            with self._cond:
                self._in_flight = False
                self._cond.notify_all()

    # ---------------------------------------------------------------- driver thread
    def _raise_error(self, caller: str) -> None:
        """Lock held: re-raise the producer's failure, chained."""
        if self._error is not None:
            iteration, exc = self._error
            raise AsyncRolloutError(f"{caller}: the rollout producer failed while collecting the batch of iteration "
                                    f"{iteration + 1}: {type(exc).__name__}: {exc}") from exc

    def _state(self) -> str:
        """Lock held: what the producer is doing, for error messages."""
        now = time.monotonic()
        doing = f"collecting iteration {self._current + 1}" if self._current is not None else "not collecting"
        rnd = f", a round in flight for {now - self._round_since:.1f} s" if self._in_flight else ""
        alive = "" if self._thread.is_alive() else " (thread ended)"
        return (f"rollout producer thread{alive} {doing}{rnd}, served policy version {self._served}, "
                f"{len(self._items)} item(s) queued")

    def take(self, iteration: int) -> RolloutItem | None:
        """The item of 0-based ``iteration``, waiting for it (``async/actor_wait_s``); None when a stop was
        requested (:meth:`stopped`) before it came.

        Raises:
            AsyncRolloutError: the producer failed (chained), ended without it, or the next item is another
                iteration's.
            DeadlineError: no item within ``item_timeout_s``.
        """
        start = time.monotonic()
        with self._cond:
            try:
                while not self._items or self._items[0].iteration != iteration:
                    if self._items:
                        raise AsyncRolloutError(f"take: the next rollout item is of iteration "
                                                f"{self._items[0].iteration + 1}, the driver is at iteration "
                                                f"{iteration + 1}")
                    self._raise_error("take")
                    if self.stopped():
                        return None
                    if not self._thread.is_alive():
                        raise AsyncRolloutError(f"take: the rollout producer ended without the batch of iteration "
                                                f"{iteration + 1} ({self._state()})")
                    waited = time.monotonic() - start
                    if waited >= self._item_timeout_s:
                        raise DeadlineError(f"asynchronous rollout, batch of iteration {iteration + 1}",
                                            self._item_timeout_s, waited, [self._state()])
                    self._cond.wait(min(POLL_S, self._item_timeout_s - waited))
                return self._items.popleft()
            finally:
                self._waits["actor_wait_s"] += time.monotonic() - start

    @contextlib.contextmanager
    def pause(self) -> Iterator[RolloutProducer]:
        """Hold the gate: no new round starts, and the round in flight (if any) ends before this yields
        (``async/drain_wait_s``). Inside, sync the weights, :meth:`publish` the version, validate.

        Raises:
            AsyncRolloutError: the producer failed (chained), before or while draining; or a nested pause.
            DeadlineError: the round in flight did not end within ``round_timeout_s``.
        """
        start = time.monotonic()
        with self._cond:
            self._raise_error("pause")
            if self._paused:
                raise AsyncRolloutError("pause: the rollout producer is already paused (pause() does not nest)")
            self._paused = True
            try:
                while self._in_flight:
                    waited = time.monotonic() - start
                    if waited >= self._round_timeout_s:
                        raise DeadlineError("asynchronous rollout, the round in flight before a weight sync",
                                            self._round_timeout_s, waited, [self._state()])
                    self._cond.wait(min(POLL_S, self._round_timeout_s - waited))
                self._raise_error("pause")
            except BaseException:
                self._paused = False
                self._cond.notify_all()
                raise
            finally:
                self._waits["drain_wait_s"] += time.monotonic() - start
        try:
            yield self
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def publish(self, version: int) -> None:
        """Inside :meth:`pause`, after a successful sync: the engines now serve policy ``version``.

        Raises:
            AsyncRolloutError: outside a pause, or a version below the served one.
        """
        with self._cond:
            if not self._paused:
                raise AsyncRolloutError(f"publish({version}): a version is published only inside pause()")
            if version < self._served:
                raise AsyncRolloutError(f"publish({version}): below the served policy version {self._served}")
            self._served = version
            self._cond.notify_all()

    def wait_metrics(self) -> dict[str, float]:
        """Seconds waited since the last call: ``async/actor_wait_s`` (the driver in :meth:`take`),
        ``async/drain_wait_s`` (the driver draining a round in :meth:`pause`), ``async/engine_wait_s`` (the
        producer parked at admission or at the paused gate, the current stretch included)."""
        with self._cond:
            if self._parked_since is not None:
                self._park(True)
            out = {f"async/{k}": v for k, v in self._waits.items()}
            self._waits = dict.fromkeys(self._waits, 0.0)
        return out

    def stop(self, timeout_s: float = 30.0) -> list[int]:
        """Stop the producer (idempotent): its waits and its collector round end at their next check; joins the
        thread for up to ``timeout_s`` s (daemon: a round stuck longer is left behind, with a warning).

        Returns:
            the 0-based iterations whose items are dropped (queued, then the one being collected), also named
            in a warning; a resumed run collects them again.
        """
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            dropped = [item.iteration for item in self._items]
            if self._current is not None:
                dropped.append(self._current)
            self._items.clear()
            self._current = None
            state = self._state()
        if dropped:
            log.warning("asynchronous rollout stopped: the batches of iteration(s) %s are dropped (collected or in "
                        "collection, not trained on)", ", ".join(str(j + 1) for j in dropped))
        if self._thread.is_alive():
            log.warning("asynchronous rollout: the producer thread did not end within %.0f s (%s)", timeout_s, state)
        return dropped


def check_groups(batch: TrainingBatch, iteration: int, max_staleness: int) -> dict[str, float]:
    """The guard on a batch consumed at 0-based ``iteration`` (the actor at policy version ``iteration``): every
    episode group (uid) was sampled by exactly one policy version ``v``, with ``0 <= iteration - v <=
    max_staleness``.

    Returns:
        ``async/staleness_mean`` and ``async/staleness_max`` (versions behind the actor, over groups) and
        ``async/group_versions_max`` (1); empty for a batch without rows.
    Raises:
        AsyncRolloutError: naming the first group of two versions, or staler than ``max_staleness`` (or newer
            than the actor), with its versions and ``rollout.asynchronous.max_staleness``; or a batch without
            ``extras["weight_version"]``.
    """
    if batch.num_rows == 0:
        return {}
    row_versions: Any = batch.extras.get("weight_version")
    if row_versions is None:
        raise AsyncRolloutError(f"iteration {iteration + 1}: the batch has no per-row extras['weight_version']")
    groups: dict[str, set[int]] = {}
    for uid, v in zip(batch.uid, row_versions, strict=True):
        groups.setdefault(uid, set()).add(int(v))
    staleness = []
    for uid, versions in groups.items():
        if len(versions) > 1:
            raise AsyncRolloutError(
                f"iteration {iteration + 1}: episode group {uid} holds rows of policy versions "
                f"{sorted(versions)}: a weight sync landed inside its round (rollout.asynchronous.max_staleness="
                f"{max_staleness})")
        (v,) = versions
        if not 0 <= iteration - v <= max_staleness:
            raise AsyncRolloutError(
                f"iteration {iteration + 1}: episode group {uid} was sampled by policy version {v}, "
                f"{iteration - v} version(s) behind the actor at version {iteration}; allowed 0.."
                f"{max_staleness} (rollout.asynchronous.max_staleness={max_staleness})")
        staleness.append(iteration - v)
    return {"async/staleness_mean": sum(staleness) / len(staleness), "async/staleness_max": float(max(staleness)),
            "async/group_versions_max": float(max(len(v) for v in groups.values()))}
