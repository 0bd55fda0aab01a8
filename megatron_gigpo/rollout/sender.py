"""The sending end of a weight sync towards one set of engines: the source rank's, or a node leader's.

:class:`EngineSender` packs (or receives) a bucket into the transport's buffer — a pooled shared-memory file
(``shm``), a CUDA buffer (``cuda_ipc``, ``broadcast`` on NCCL) or a CPU buffer (``broadcast`` on gloo) — and issues
its engines' ``receive_bucket`` calls. The source rank (:func:`megatron_gigpo.rollout.weight_sync.push_weights`)
serves the engines of its own node with it; with the per-node relay (:mod:`megatron_gigpo.rollout.relay`) each
node leader serves its own node's engines the same way. Same-node transports (``shm``, ``cuda_ipc``) check that
every engine served is on the sender's Ray node.

Process-wide state (built on first use, kept between syncs): the ``shm`` bucket pool and the broadcast groups;
:func:`release_sender_resources` frees both.
"""

from __future__ import annotations

import socket
from typing import Any, Sequence

import torch

from megatron_gigpo.deadlines import get_with_deadline
from megatron_gigpo.rollout.errors import WeightSyncError
from megatron_gigpo.rollout.transport import (
    BucketLayout,
    SharedMemoryPool,
    broadcast_group,
    cuda_ipc_handle,
    dtype_from_name,
    pack_bucket,
    plan_layout,
)

__all__ = ["SAME_NODE_TRANSPORTS", "EngineSender", "release_sender_resources", "engine_labels"]

# Transports whose buffer can only be opened on the sender's node.
SAME_NODE_TRANSPORTS = ("shm", "cuda_ipc")

# Broadcast groups and the shm bucket pool of this process; built on first use.
_SENDER_GROUPS: dict[str, Any] = {}
_SHM_POOL: list[SharedMemoryPool] = []  # at most one


def release_sender_resources() -> None:
    """Free what earlier syncs kept in this process (source rank or node leader): the shm bucket pool and the
    broadcast groups. Optional: process exit frees both too. The next sync rebuilds them (engines re-join a new
    group)."""
    for pool in _SHM_POOL:
        pool.close()
    _SHM_POOL.clear()
    _SENDER_GROUPS.clear()


def engine_labels(indices: Sequence[int]) -> list[str]:
    """``["engine 0", ...]`` for error messages."""
    return [f"engine {i}" for i in indices]


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _broadcast_sender(plan):
    """The source's broadcast group with every worker of every engine (joined on first use, then cached)."""
    group = _SENDER_GROUPS.get(plan.group_key)
    if group is not None:
        return group
    host, port = _node_ip(), _free_port()
    world = 1 + sum(plan.engine_workers)
    offsets = [1 + sum(plan.engine_workers[:i]) for i in range(len(plan.engines))]
    refs = [
        e.join_broadcast_group.remote(host, port, off, world, plan.backend, plan.timeout_s)
        for e, off in zip(plan.engines, offsets)
    ]
    group = broadcast_group(host, port, 0, world, plan.backend, plan.timeout_s)
    get_with_deadline(refs, plan.timeout_s, "engines joining the weight broadcast group",
                      labels=engine_labels(range(len(plan.engines))))
    _SENDER_GROUPS[plan.group_key] = group
    return group


class EngineSender:
    """Packs buckets for one transport and issues the receive calls of the engines ``indices`` of ``plan``.

    Args:
        plan: the sync's :class:`~megatron_gigpo.rollout.weight_sync.SyncPlan`.
        indices: the engines this process serves (the source: all but the relayed ones; a leader: its node's).
        who: this process in error messages (``"the source rank 0"``, ``"node leader rank 8"``).

    Raises:
        WeightSyncError: a same-node transport and an engine on another Ray node than this process.
    """

    def __init__(self, plan, indices: Sequence[int], who: str):
        self.plan, self.indices, self.who = plan, tuple(indices), who
        self.engines = [plan.engines[i] for i in self.indices]
        self.labels = engine_labels(self.indices)
        self.dtype = dtype_from_name(plan.spec.dtype)
        self.group = _broadcast_sender(plan) if plan.transport == "broadcast" else None
        self.pool: SharedMemoryPool | None = None
        if plan.transport in SAME_NODE_TRANSPORTS:
            self._check_same_node()  # a shm file / CUDA IPC handle opens only on its own node
        if plan.transport == "shm":
            if not plan.reuse_shm:
                self.pool = SharedMemoryPool()
            else:
                if not _SHM_POOL:
                    _SHM_POOL.append(SharedMemoryPool())
                self.pool = _SHM_POOL[0]

    def _check_same_node(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        here = ray.get_runtime_context().get_node_id()
        away = [i for i in self.indices if self.plan.engine_nodes[i] != here]
        if away:
            raise WeightSyncError(
                f"transport '{self.plan.transport}' reaches only engines on the node of its sender, {self.who}; "
                f"engines {away} are on other nodes. Relay through a rank on each engine node (sync_weights(..., "
                "relays=megatron_gigpo.cluster.placement.weight_relays(plan)), as the run does) or use "
                "rollout.weight_sync_mode=disaggregated (transport 'broadcast')"
            )

    def buffer(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        """A send buffer of at least ``nbytes`` bytes on the transport's device; returns (flat, keepalive)."""
        if self.plan.transport == "shm":
            shm = self.pool.acquire(nbytes)
            return shm.buffer, shm
        if self.group is not None:
            device = self.group.device
        elif self.plan.transport == "cuda_ipc":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return torch.empty(nbytes, dtype=torch.uint8, device=device), None

    def pack(self, bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, BucketLayout, Any]:
        """Cast and copy a bucket into a send buffer; returns (flat buffer, layout, keepalive object)."""
        layout = plan_layout(bucket, self.dtype)
        if self.plan.transport == "shm":
            flat, keepalive = self.buffer(layout.nbytes)
        else:  # a CUDA IPC buffer lives on the tensors' own GPU
            device = self.group.device if self.group is not None else bucket[0][1].device
            flat, keepalive = torch.empty(layout.nbytes, dtype=torch.uint8, device=device), None
        flat, layout = pack_bucket(bucket, self.dtype, out=flat)
        return flat, layout, keepalive

    def send(self, flat: torch.Tensor, layout: BucketLayout, keepalive) -> list:
        """Start the engines' receive calls (and, for broadcast, the broadcast itself); returns their refs."""
        wire = layout.to_wire()
        if self.plan.transport == "shm":
            desc = {"transport": "shm", "path": keepalive.path, "layout": wire}
        elif self.plan.transport == "cuda_ipc":
            desc = {"transport": "cuda_ipc", "handle": cuda_ipc_handle(flat), "layout": wire}
        else:
            desc = {"transport": "broadcast", "layout": wire}
        refs = [e.receive_bucket.remote(desc) for e in self.engines]
        if self.plan.transport == "broadcast":
            self.group.broadcast(flat)
        return refs

    def done(self, keepalive) -> None:
        """A bucket's receivers have staged it: a one-off file can be closed now (their mappings keep it)."""
        if keepalive is not None and not self.plan.reuse_shm:
            keepalive.close()

    def finish(self) -> None:
        """The sync is over (committed or aborted): pooled files may be rewritten."""
        if self.pool is not None:
            self.pool.release_all()
            if not self.plan.reuse_shm:
                self.pool.close()
