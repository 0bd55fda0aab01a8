"""Trainer sides of our CPU backends of vLLM 0.32's weight-transfer protocol: ``mgigpo_shm`` and ``mgigpo_gloo``.

Both implement ``vllm.distributed.weight_transfer.base.TrainerWeightTransferEngine`` (``trainer_init`` on every
actor rank, then per update ``send_weights()`` on every rank) over a
:class:`~megatron_gigpo.rollout.transfer.source.MegatronExportSource` and an
:class:`~megatron_gigpo.rollout.transfer.client.EngineGroupClient`. Per update the sender (trainer rank 0) calls
``start_weight_update``, one ``update_weights`` per export bucket, then ``finish_weight_update()``, which the client
turns into the commit chunk (checksum of the whole set) + a versioned finish. Errors are raised after the last
bucket; the caller (:func:`megatron_gigpo.rollout.weight_sync.push_weights`) aborts the engines.

- :class:`SharedMemoryTrainerEngine` (colocated, any number of nodes): on each node that hosts engines, the
  lowest actor rank writes every bucket into a pooled shared-memory file (``transport.SharedMemoryPool``); the
  sender broadcasts the packed bucket to those writers over a gloo subgroup of the actor ranks' default group and
  gathers their paths: the chunk ``{"paths": {node_key: path}, "layout", "digests"}`` lets each engine map its own
  node's file (the Ray node id is the node key). Files stay untouched until the next update starts.
- :class:`GlooTrainerEngine` (disaggregated): the sender and every worker of every engine form one
  ``transport._GlooBroadcast`` group (engine k's workers at ``rank_offset = 1 + workers of engines < k``); per bucket
  the engines' ``update_weights`` calls are issued, then the sender broadcasts the packed bytes.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from megatron_gigpo.rollout.errors import WeightSyncError
from megatron_gigpo.rollout.transport import (
    BucketLayout,
    SharedMemoryPool,
    _GlooBroadcast,
    dtype_from_name,
    initialized_dist,
    pack_bucket,
    plan_layout,
)
from megatron_gigpo.rollout.vllm_plugin import GLOO_BACKEND, SHM_BACKEND

__all__ = ["SharedMemoryTrainerInitInfo", "SharedMemoryTrainerEngine", "GlooTrainerInitInfo", "GlooTrainerEngine",
           "node_writers"]

def _ray_node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


def node_writers(rank_nodes: list[str], engine_nodes: list[str], backend: str = SHM_BACKEND) -> dict[str, int]:
    """``{node key: writer rank}``: for every node with engines, the lowest actor rank on it.

    Args:
        rank_nodes: node key of each actor rank (index = rank).
        engine_nodes: node key of each engine.

    Raises:
        WeightSyncError: an engine's node has no actor rank (names the engine and the node).
    """
    writers: dict[str, int] = {}
    for k, node in enumerate(engine_nodes):
        if node not in rank_nodes:
            raise WeightSyncError(f"engine {k} on node {node} has no actor rank there: {backend} needs one "
                                  "(use rollout.weight_sync_mode=disaggregated)")
        writers[node] = rank_nodes.index(node)
    return writers


def _bucket_chunk(layout: BucketLayout, source) -> dict[str, Any]:
    return {"layout": layout.to_wire(), "digests": [source.digests[name].hex() for name in layout.names]}


# ---------------------------------------------------------------------------------------------------------
# mgigpo_shm
# ---------------------------------------------------------------------------------------------------------


@dataclass
class SharedMemoryTrainerInitInfo(TrainerInitInfo):
    """Trainer init info of ``mgigpo_shm``.

    Attributes:
        dtype: transfer dtype name (the engines' model dtype: ``"float32"``, ``"bfloat16"``, ``"float16"``).
        engine_nodes: Ray node id of each engine (the key of its node's file), in the client's engine order.
        reuse_files: keep the bucket files for the next update (faster: a warm copy; holds the model's bytes of
            shared memory per engine node between updates), else close them when the next update starts.
    """

    backend: ClassVar[str] = SHM_BACKEND
    dtype: str = "float32"
    engine_nodes: tuple[str, ...] = ()
    reuse_files: bool = True


class SharedMemoryTrainerEngine(TrainerWeightTransferEngine[SharedMemoryTrainerInitInfo]):
    """Trainer side of ``mgigpo_shm`` (see the module doc). ``trainer_init`` is a collective of every actor rank
    (node keys are all-gathered, the writers' gloo subgroup is created); so is each ``send_weights``.

    Attributes:
        pool: this rank's bucket files (writers only; None elsewhere).
        writers: ``{node key: writer rank}``.
        pack_s, send_s, num_buckets: of the last update (seconds; count).
    """

    init_info_cls = SharedMemoryTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender: bool = True, rank: int = 0, dtype: str = "float32",
                 writers: dict[str, int] | None = None, group: Any = None, reuse_files: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.rank, self.dtype, self.reuse_files = rank, dtype_from_name(dtype), reuse_files
        self.writers = dict(writers or {})
        self.members = sorted({0, *self.writers.values()})  # the subgroup: sender + node writers
        self.group = group
        self.node_key = next((node for node, r in self.writers.items() if r == rank), None)
        self.pool = SharedMemoryPool() if self.node_key is not None else None
        self.pack_s = self.send_s = 0.0
        self.num_buckets = 0

    @classmethod
    def trainer_init(cls, init_info: SharedMemoryTrainerInitInfo, *, client, source=None):
        """Every actor rank: find the node writers, build their subgroup; the sender inits the engines
        (``{"dtype", "node_key"}`` each).

        Raises:
            WeightSyncError: an engine's node has no actor rank.
        """
        dist, here = initialized_dist(), _ray_node_id()
        rank_nodes = [here]
        if dist is not None and dist.get_world_size() > 1:
            rank_nodes = [None] * dist.get_world_size()
            dist.all_gather_object(rank_nodes, here)
        writers = node_writers(rank_nodes, list(init_info.engine_nodes))
        members = sorted({0, *writers.values()})
        # new_group is a collective of the default group: every rank calls it, also non-members.
        group = dist.new_group(members, backend="gloo") if dist is not None and len(members) > 1 else None
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank,
                     dtype=init_info.dtype, writers=writers, group=group, reuse_files=init_info.reuse_files)
        if engine.is_sender:
            client.init_weight_transfer_engine([{"dtype": init_info.dtype, "node_key": node}
                                                for node in init_info.engine_nodes])
        return engine

    def send_weights(self) -> None:
        """One update, on every actor rank (see the module doc).

        Raises:
            WeightSyncError: (sender) a writer could not write its node's file, or an engine refused a chunk; the
                source's own error is raised by the client's finish. Raised after the whole export was iterated.
        """
        if self.pool is not None:  # the engines finished (or aborted) the previous update: files are free again
            self.pool.release_all()
            if not self.reuse_files:
                self.pool.close()
        self.pack_s = self.send_s = 0.0
        self.num_buckets = 0
        if self.rank not in self.members:
            self.source.drain()
            return
        error: BaseException | None = None
        if self.is_sender:
            try:
                self.client.start_weight_update()
            except BaseException as exc:  # noqa: BLE001 - the writers wait for this update's headers
                error = exc
        pending: list = []
        for bucket in self.source.iter_buckets():
            try:
                failed = self._exchange(bucket if error is None else [], pending)
            except BaseException as exc:  # noqa: BLE001 - keep in lockstep with the writers and the export
                failed = exc
            error = error or failed
        if self.is_sender:
            self._settle(pending)
            if error is not None:
                raise error
            self.client.finish_weight_update()
            if not self.reuse_files and self.pool is not None:  # loaded: the engines dropped their mappings
                self.pool.close()

    def _exchange(self, bucket: list, pending: list) -> BaseException | None:
        """One export step of a subgroup member: the sender packs and broadcasts, writers write, paths are
        gathered, the sender issues the chunk. Returns a writer's error (sender), else None."""
        layout = plan_layout(bucket, self.dtype) if bucket else None
        if self.group is not None:  # tell the writers whether (and what) this step sends
            header = [layout.to_wire() if layout is not None else None]
            torch.distributed.broadcast_object_list(header, src=0, group=self.group)
            layout = BucketLayout.from_wire(header[0]) if header[0] is not None else None
        if layout is None:
            return None
        tick = time.perf_counter()
        path, flat = None, None
        try:
            path, flat = self._write(bucket, layout)
        except BaseException as exc:  # noqa: BLE001 - reported to the sender through the gather
            path = {"error": f"rank {self.rank} (writer of node {self.node_key}): {type(exc).__name__}: {exc}"}
        self.pack_s += time.perf_counter() - tick
        paths = [(self.node_key, path)]
        if self.group is not None:
            paths = [None] * len(self.members)
            torch.distributed.all_gather_object(paths, (self.node_key, path), group=self.group)
        if not self.is_sender:
            return None
        errors = [p["error"] for _, p in paths if isinstance(p, dict)]
        if errors:
            return WeightSyncError("shared-memory bucket not written: " + "; ".join(errors))
        self._settle(pending)  # one bucket in flight: the engines stage it while the next one is exported
        chunk = {"paths": {node: p for node, p in paths if node is not None}, **_bucket_chunk(layout, self.source)}
        pending.append(self.client.update_weights_async(chunk))
        self.num_buckets += 1
        return None

    def _write(self, bucket: list, layout: BucketLayout) -> tuple[str | None, torch.Tensor | None]:
        """Pack (sender) or receive (other writers) the bucket's bytes into this rank's file, if it is a writer."""
        if self.pool is not None:
            shm = self.pool.acquire(layout.nbytes)
            flat, path = shm.buffer[: layout.nbytes], shm.path
        else:
            flat, path = torch.empty(layout.nbytes, dtype=torch.uint8), None
        if self.is_sender:
            pack_bucket(bucket, self.dtype, out=flat)
        if self.group is not None:
            torch.distributed.broadcast(flat, src=0, group=self.group)
        return path, flat

    def _settle(self, pending: list) -> None:
        tick = time.perf_counter()
        while pending:
            self.client.wait(pending.pop(0), f"update_weights (version {self.client.version})")
        self.send_s += time.perf_counter() - tick

    def shutdown(self) -> None:
        """Close this rank's bucket files (the engines' mappings stay valid)."""
        if self.pool is not None:
            self.pool.close()


# ---------------------------------------------------------------------------------------------------------
# mgigpo_gloo
# ---------------------------------------------------------------------------------------------------------


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer init info of ``mgigpo_gloo``.

    Attributes:
        dtype: transfer dtype name (the engines' model dtype).
        world_size: 1 (the sender) + every worker of every engine.
        host: the sender's address, reachable from the engines' nodes (its TCP store).
        port: a free TCP port on ``host``; 0 picks one.
        timeout_s: the group's store and collective timeout, seconds.
    """

    backend: ClassVar[str] = GLOO_BACKEND
    dtype: str = "float32"
    world_size: int = 2
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 600.0


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class GlooTrainerEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side of ``mgigpo_gloo`` (see the module doc). Only the sender joins the group; other ranks drain
    their export. After an error the group may be out of step (a worker that refused a bucket does not receive
    it): :attr:`broken` is set and the caller builds a new engine (new group) for the next update.

    Attributes:
        pack_s, send_s, num_buckets: of the last update (seconds; count).
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender: bool = True, dtype: str = "float32", group=None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.dtype, self.group, self.broken = dtype_from_name(dtype), group, False
        self.pack_s = self.send_s = 0.0
        self.num_buckets = 0

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        """The sender issues every engine's ``init_weight_transfer_engine`` (their workers block joining), joins the
        group as rank 0, then waits for the engines. Other ranks return at once.

        Raises:
            WeightSyncError / megatron_gigpo.deadlines.DeadlineError: an engine failed or did not join in time.
        """
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False, dtype=init_info.dtype)
        port = init_info.port or _free_port(init_info.host)
        refs = client.init_weight_transfer_engine_async(
            {"dtype": init_info.dtype, "host": init_info.host, "port": port, "rank_offset": 1,
             "world_size": init_info.world_size, "timeout_s": init_info.timeout_s})
        group = _GlooBroadcast(init_info.host, port, 0, init_info.world_size, init_info.timeout_s)
        client.wait(refs, "init_weight_transfer_engine (joining the gloo broadcast group)")
        return cls(client=client, source=source, is_sender=True, dtype=init_info.dtype, group=group)

    def send_weights(self) -> None:
        """One update, on every actor rank: the sender starts, sends each bucket (Ray calls first, then the
        broadcast, then their results), and finishes through the client; other ranks drain their export.

        Raises:
            WeightSyncError (or a gloo error / DeadlineError): an engine refused a chunk or the group failed.
        """
        self.pack_s = self.send_s = 0.0
        self.num_buckets = 0
        if not self.is_sender:
            self.source.drain()
            return
        self.client.start_weight_update()
        try:
            for bucket in self.source.iter_buckets():
                if bucket:
                    self._send(bucket)
        except BaseException:
            self.broken = True
            raise
        self.client.finish_weight_update()

    def _send(self, bucket: list) -> None:
        tick = time.perf_counter()
        flat, layout = pack_bucket(bucket, self.dtype)
        self.pack_s += time.perf_counter() - tick
        tick = time.perf_counter()
        refs = self.client.update_weights_async(_bucket_chunk(layout, self.source))
        self.group.broadcast(flat)
        self.client.wait(refs, f"update_weights (version {self.client.version})")
        self.send_s += time.perf_counter() - tick
        self.num_buckets += 1

    def shutdown(self) -> None:
        """Drop the group (the engines join a new one at the next ``trainer_init``)."""
        self.group = None
