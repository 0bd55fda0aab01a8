"""Deadlines for every blocking wait on Ray: actor and engine start, calls on ranks, engines and placement groups.

:func:`get_with_deadline` is ``ray.get`` with a finite timeout. It returns as soon as every result is in and
raises the first remote error as soon as it arrives (``ray.get`` of a list would wait for the slowest first).
When the deadline passes it raises :class:`DeadlineError`, whose message names the wait, each call that did not
answer (its label, the Ray actor class and id, the node IP and process id, or that the actor was never placed
because no node had its resources) and how long it waited. The recipe's deadlines live in
``trainer.timeouts`` (:class:`megatron_gigpo.run.config.TimeoutsConfig`).

Node and state come from Ray's GCS actor table (``ray._private.state.actors``; no dashboard needed); where that
is unavailable the message says so instead of failing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["DeadlineError", "get_with_deadline", "describe_actor", "wait_placement_group"]


class DeadlineError(TimeoutError):
    """A blocking wait passed its deadline.

    Attributes:
        what: the wait (e.g. ``"vLLM engine start"``).
        timeout_s: its deadline in seconds.
        elapsed_s: seconds waited.
        pending: one description per call that did not answer.
    """

    def __init__(self, what: str, timeout_s: float, elapsed_s: float, pending: list[str], context: str = ""):
        self.what, self.timeout_s, self.elapsed_s, self.pending = what, timeout_s, elapsed_s, pending
        listed = "; ".join(pending[:8]) + (f"; and {len(pending) - 8} more" if len(pending) > 8 else "")
        deadline = f"{timeout_s:.1f}".removesuffix(".0")
        message = (f"{what}: no answer after {elapsed_s:.1f} s (deadline {deadline} s) from {len(pending)} "
                   f"call(s): {listed}")
        super().__init__(message + (f". {context}" if context else ""))


def _actor_info(actor_id_hex: str) -> dict | None:
    try:
        from ray._private import state

        info = state.actors(actor_id=actor_id_hex)
    except Exception:  # noqa: BLE001 - a description must never hide the deadline error itself
        return None
    return info if isinstance(info, dict) and info else None


def describe_actor(handle_or_ref: Any) -> str:
    """``"actor RolloutEngine 1a2b3c4d on node 10.0.0.5 (pid 4242, ALIVE)"`` for an actor handle or a ref of
    one of its calls; ``"... not running on any node yet (PENDING_CREATION: ...)"`` while Ray has found no node with
    its resources or its process is still starting; ``"a task"`` for a ref that is not an actor call."""
    try:
        actor_id = getattr(handle_or_ref, "_actor_id", None)
        if actor_id is None:
            actor_id = handle_or_ref.task_id().actor_id()
        if actor_id.is_nil():
            return "a task"
        hex_id = actor_id.hex()
    except Exception:  # noqa: BLE001
        return "an unknown actor"
    info = _actor_info(hex_id)
    if info is None:
        return f"actor {hex_id[:8]} (node unknown: Ray's actor table did not answer)"
    name = f"actor {info.get('ActorClassName', '?')} {hex_id[:8]}"
    state, address, pid = info.get("State", "?"), info.get("Address") or {}, info.get("Pid") or 0
    ip = address.get("IPAddress") or ""
    if not ip or (state in ("DEPENDENCIES_UNREADY", "PENDING_CREATION") and not pid):
        return (f"{name} not running on any node yet ({state}: Ray has found no node with its resources, its "
                f"placement group is not ready, or its process is still starting)")
    return f"{name} on node {ip} (pid {pid}, {state})"


def get_with_deadline(refs: Any, timeout_s: float, what: str, *, labels: Sequence[str] | None = None,
                      context: Callable[[], str] | None = None, actors: bool = True,
                      started_at: float | None = None) -> Any:
    """``ray.get(refs)`` that waits at most ``timeout_s`` seconds.

    Args:
        refs: one ``ObjectRef`` or a sequence of them.
        timeout_s: the deadline in seconds (> 0).
        what: the wait, for the error message (``"PolicyActor.update on the actor ranks"``).
        labels: one label per ref (``"rank 3"``); default: the position.
        context: called only on a time-out; its text is appended to the message (e.g. cluster resources).
        actors: describe the actor behind each late ref (False for refs that are not actor calls).
        started_at: the ``time.monotonic()`` at which the deadline's clock started (default: now), for a wait
            that began earlier, e.g. at an actor's launch: the deadline is ``started_at + timeout_s`` and the
            error reports the seconds since ``started_at``. Refs that are ready count even when the deadline
            has already passed.

    Returns:
        The value (one ref) or the list of values (a sequence), in order.

    Raises:
        DeadlineError: some call did not answer in time (every such call is named); raised only once
            ``timeout_s`` have passed since ``started_at``.
        ray.exceptions.RayError: the first remote failure, as soon as it arrives.
        ValueError: ``timeout_s`` is not a positive finite number.
    """
    import ray

    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"{what}: timeout_s={timeout_s} must be a positive, finite number of seconds")
    single = isinstance(refs, ray.ObjectRef)
    ordered = [refs] if single else list(refs)
    names = list(labels) if labels is not None else [f"call {i}" for i in range(len(ordered))]
    if len(names) != len(ordered):
        raise ValueError(f"{what}: {len(names)} labels for {len(ordered)} refs")
    start = time.monotonic() if started_at is None else started_at
    pending = {ref: i for i, ref in enumerate(ordered)}
    results: list[Any] = [None] * len(ordered)
    while pending:
        remaining = start + timeout_s - time.monotonic()
        ready = ray.wait(list(pending), num_returns=1, timeout=max(remaining, 0.0))[0]
        for ref in ready:
            results[pending.pop(ref)] = ray.get(ref)
        # An empty answer before the deadline goes round again: ray.wait's own timer can end a fraction of a
        # millisecond before ours (seen: a deadline of 5 s reported after 4.9997 s).
        elapsed = time.monotonic() - start
        if pending and not ready and elapsed >= timeout_s:
            late = [f"{names[i]} ({describe_actor(ref)})" if actors else names[i]
                    for ref, i in sorted(pending.items(), key=lambda x: x[1])]
            raise DeadlineError(what, timeout_s, elapsed, late, context() if context else "")
    return results[0] if single else results


def wait_placement_group(pg: Any, timeout_s: float, what: str, *, started_at: float | None = None) -> None:
    """Wait until placement group ``pg`` has reserved all its bundles, at most until ``timeout_s`` after
    ``started_at`` (``time.monotonic()``; default: now), as :func:`get_with_deadline`.

    Raises:
        DeadlineError: not reserved in time; the message gives the bundles asked for, the group's state and
            the cluster's total and available resources.
    """
    import ray
    from ray.util.placement_group import placement_group_table

    def context() -> str:
        try:
            state = placement_group_table(pg).get("state", "?")
        except Exception:  # noqa: BLE001
            state = "?"
        return (f"Placement group state {state}; bundles asked for: {pg.bundle_specs}; cluster resources: "
                f"{ray.cluster_resources()}, available: {ray.available_resources()}")

    get_with_deadline(pg.ready(), timeout_s, what, labels=[f"placement group of {pg.bundle_count} bundles"],
                      context=context, actors=False, started_at=started_at)
