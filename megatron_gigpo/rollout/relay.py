"""Per-node relay of a colocated weight sync: engines on other nodes than the source rank's.

Same-node transports (``shm`` files, CUDA IPC handles) open only on the node that made them. When a run's engines
span several nodes, each other node has a *leader*: its lowest actor rank (the placement plan's
:func:`megatron_gigpo.cluster.placement.weight_relays`, carried in :attr:`SyncPlan.relays`). The source rank sends every
packed flat bucket and its layout to the leaders over a torch.distributed subgroup of the actor ranks (source +
leaders; gloo for ``shm``, NCCL for ``cuda_ipc``; created once by every actor rank and cached); each leader
receives it straight into its own transport buffer and hands it to its node's engines exactly as the source does
for its own node (:class:`~megatron_gigpo.rollout.sender.EngineSender`).

Protocol, in lockstep with the export (``export_hf_weights`` yields the same number of buckets on every rank, and
its gathers may involve the leaders): for every bucket the export yields, the source broadcasts one header
``int64[kind, nbytes, meta_len]`` — ``BUCKET`` (then the layout as JSON bytes, then the ``nbytes`` of the flat
buffer), ``SKIP`` (an empty bucket) or ``ABORT`` (the source failed; no more messages until the status exchange)
— before it pulls the next bucket. After the last bucket (or the abort), every leader waits for its engines to
stage what it sent and reports its status (empty or its error's text) to the source. The source commits or aborts
every engine itself, as without a relay: every engine still hashes what it staged and checks the source's
checksum, and a leader's error aborts the update on all engines.
"""

from __future__ import annotations

import datetime
import json
import time
from collections import deque
from typing import Any, Sequence

import torch

from megatron_gigpo.deadlines import get_with_deadline
from megatron_gigpo.rollout.sender import EngineSender
from megatron_gigpo.rollout.transport import BucketLayout

__all__ = ["relay_group", "RelaySource", "serve_node", "SKIP", "BUCKET", "ABORT"]

SKIP, BUCKET, ABORT = 0, 1, 2
# The relay group's collectives wait this much longer than the sync's deadline, so that a leader whose engines
# do not answer reports that (at its deadline) before the source's wait for the report times out.
GROUP_GRACE_S = 60.0

# torch.distributed subgroups of the actor ranks, keyed by (members, backend); built on first use by every rank.
_RELAY_GROUPS: dict[tuple[tuple[int, ...], str], Any] = {}


def relay_group(plan) -> Any:
    """The subgroup ``(source rank, leaders...)`` of the actor ranks' default group (cached).

    Every actor rank must call this at the same point (``torch.distributed.new_group`` is a collective of the
    default group); non-members get torch's non-member token.
    """
    members = tuple(sorted({plan.source_rank, *plan.relay_leaders}))
    key = (members, plan.backend)
    if key not in _RELAY_GROUPS:
        _RELAY_GROUPS[key] = torch.distributed.new_group(
            ranks=list(members), backend=key[1],
            timeout=datetime.timedelta(seconds=plan.timeout_s + GROUP_GRACE_S))
    return _RELAY_GROUPS[key]


class _Link:
    """Broadcasts from one member to the others in the relay group."""

    def __init__(self, plan, group):
        self.plan, self.group = plan, group
        self.device = (torch.device("cuda", torch.cuda.current_device()) if plan.backend == "nccl"
                       else torch.device("cpu"))

    def bcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        torch.distributed.broadcast(tensor, src=src, group=self.group)
        if tensor.is_cuda:  # the engines open the buffer from other processes: the bytes must be there first
            torch.cuda.current_stream().synchronize()
        return tensor

    def header(self, kind: int = 0, nbytes: int = 0, meta_len: int = 0) -> tuple[int, int, int]:
        """Send (source) or receive (leader) one header."""
        h = torch.tensor([kind, nbytes, meta_len], dtype=torch.int64, device=self.device)
        return tuple(int(v) for v in self.bcast(h, self.plan.source_rank).tolist())

    def text(self, data: bytes | None, src: int, length: int) -> bytes:
        """Send ``data`` (from ``src``) or receive ``length`` bytes of it."""
        t = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None
             else torch.empty(length, dtype=torch.uint8)).to(self.device)
        return self.bcast(t, src).cpu().numpy().tobytes()

    def statuses(self, mine: str | None, rank: int) -> dict[int, str]:
        """Each leader in turn sends its status text ("" = ok); returns {leader: text}."""
        out = {}
        for leader in self.plan.relay_leaders:
            encoded = (mine or "").encode() if leader == rank else None
            n = torch.tensor([len(encoded) if encoded is not None else 0], dtype=torch.int64, device=self.device)
            n = int(self.bcast(n, leader).item())
            out[leader] = self.text(encoded, leader, n).decode(errors="replace") if n else ""
        return out


class RelaySource:
    """The source rank's end of the relay (a no-op without relays). Call exactly one of :meth:`send`,
    :meth:`skip` or :meth:`abort` per bucket the export yields, until :meth:`abort`; then :meth:`close` once."""

    def __init__(self, plan):
        self.plan = plan
        self.link = _Link(plan, relay_group(plan)) if plan.relays else None
        self.open = self.link is not None  # buckets may still be sent
        self.closed = self.link is None
        self.broken = False  # a broadcast failed: the group is out of step, say nothing more

    def _guard(self, fn, *args) -> Any:
        try:
            return fn(*args)
        except BaseException:
            self.broken, self.open = True, False
            raise

    def send(self, flat: torch.Tensor, layout: BucketLayout) -> None:
        """Relay one packed bucket (``flat[:layout.nbytes]``, on the relay device) and its layout."""
        if not self.open:
            return
        meta = json.dumps(layout.to_wire()).encode()
        self._guard(self.link.header, BUCKET, layout.nbytes, len(meta))
        self._guard(self.link.text, meta, self.plan.source_rank, len(meta))
        self._guard(self.link.bcast, flat[: layout.nbytes], self.plan.source_rank)

    def skip(self) -> None:
        if self.open:
            self._guard(self.link.header, SKIP)

    def abort(self) -> None:
        """Tell the leaders to stop (idempotent)."""
        if self.open:
            self.open = False
            self._guard(self.link.header, ABORT)

    def close(self) -> dict[int, str]:
        """After the last bucket or the abort: the leaders' statuses ``{leader rank: error text}`` (failures
        only; idempotent, {} on later calls or when the group is out of step)."""
        if self.closed or self.broken:
            return {}
        self.closed, self.open = True, False
        return {rank: text for rank, text in self.link.statuses(None, self.plan.source_rank).items() if text}


def serve_node(buckets, plan, rank: int) -> None:
    """A node leader's part of the sync: receive every bucket from the source and hand it to this node's engines.

    Args:
        buckets: this rank's own export iterator (consumed in lockstep; its buckets are empty on a leader).
        plan: the sync's :class:`~megatron_gigpo.rollout.weight_sync.SyncPlan`; ``rank`` is one of its leaders.

    Errors of the engines or of the transport are not raised here: they go to the source rank, which aborts the
    update on every engine and raises. An error of the relay group itself (a broadcast timing out) is raised.
    """
    link = _Link(plan, relay_group(plan))
    engines = plan.relay_engines(rank)
    started = time.monotonic()  # every engine wait below ends plan.timeout_s after this
    error: BaseException | None = None
    sender: EngineSender | None = None
    inflight: deque = deque()
    try:
        sender = EngineSender(plan, engines, f"node leader rank {rank}")
    except BaseException as exc:  # noqa: BLE001 - reported to the source
        error = exc
    listening = True
    for _ in buckets:
        if not listening:
            continue
        kind, nbytes, meta_len = link.header()
        if kind == ABORT:
            listening = False
        elif kind == BUCKET:
            flat, layout, keepalive, error = _receive(link, sender, error, nbytes, meta_len)
            if error is None:
                error = _hand_over(sender, inflight, flat, layout, keepalive, started)
    error = _settle(sender, inflight, 0, started) if error is None else error
    for _, keepalive in inflight:
        sender.done(keepalive)
    if sender is not None:
        sender.finish()
    link.statuses(_describe(error, rank, engines), rank)


def _receive(link: _Link, sender: EngineSender | None, error: BaseException | None, nbytes: int, meta_len: int):
    """Receive one bucket's layout and bytes, into ``sender``'s transport buffer unless an error came first (the
    bytes are received in any case, to stay in step); returns (flat, layout, keepalive, error)."""
    meta = link.text(None, link.plan.source_rank, meta_len)
    flat, layout, keepalive = None, None, None
    if error is None:
        try:
            layout = BucketLayout.from_wire(json.loads(meta))
            flat, keepalive = sender.buffer(nbytes)
        except BaseException as exc:  # noqa: BLE001 - reported to the source
            error = exc
    if flat is None:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=link.device)
    link.bcast(flat[:nbytes], link.plan.source_rank)
    return flat, layout, keepalive, error


def _hand_over(sender: EngineSender, inflight: deque, flat, layout, keepalive, started: float):
    """Start the engines' receive of one bucket (after settling older ones); returns the error or None."""
    error = _settle(sender, inflight, sender.plan.max_inflight_buckets - 1, started)
    if error is not None:
        sender.done(keepalive)
        return error
    try:
        inflight.append((sender.send(flat, layout, keepalive), keepalive))
    except BaseException as exc:  # noqa: BLE001 - reported to the source
        sender.done(keepalive)
        return exc
    return None


def _settle(sender: EngineSender | None, inflight: deque, limit: int, started: float):
    """Wait until at most ``limit`` buckets are unacknowledged, at most until ``plan.timeout_s`` after
    ``started`` (``time.monotonic()``); returns the first error or None."""
    while sender is not None and len(inflight) > limit:
        refs, keepalive = inflight.popleft()
        try:
            get_with_deadline(refs, sender.plan.timeout_s,
                              f"receive_bucket (version {sender.plan.version}) on the rollout engines of "
                              f"{sender.who}", labels=sender.labels, started_at=started)
        except BaseException as exc:  # noqa: BLE001 - reported to the source
            return exc
        finally:
            sender.done(keepalive)
    return None


def _describe(error: BaseException | None, rank: int, engines: Sequence[int]) -> str:
    if error is None:
        return ""
    cause = getattr(error, "cause", None)
    error = cause if isinstance(cause, BaseException) else error
    return f"node leader rank {rank} (engines {list(engines)}): {type(error).__name__}: {error}"
