"""PROVISIONAL (#39, engine branch): trainer side of ``mgigpo_shm``, the probe's ``SharedMemoryTrainerEngine`` with
node-keyed paths, kept only so the engine-side tests can drive a full update. The trainer-side branch owns this file
and replaces it (multi-node shm, ``GlooTrainerEngine``, contract: /work/notes/helpers/i39-contract.md).

vLLM 0.32 ``TrainerWeightTransferEngine`` over a ``WeightSource``: ``send_weights(weight_version)`` runs start, one
``update_weights`` per bucket ``{"paths": {node_key: path}, "layout", "digests"}``, ``{"commit": checksum}``,
``finish_weight_update(weight_version)``; on any error ``{"abort": reason}`` + ``finish_weight_update(None)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from megatron_gigpo.rollout.checksum import combine_digests, tensor_digest
from megatron_gigpo.rollout.transport import ALIGN_BYTES, SharedMemoryPool, dtype_from_name, pack_bucket, unpack_bucket
from megatron_gigpo.rollout.vllm_plugin import SHM_BACKEND

__all__ = ["SharedMemoryTrainerInitInfo", "SharedMemoryTrainerEngine"]

log = logging.getLogger(__name__)


@dataclass
class SharedMemoryTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of ``mgigpo_shm``: transfer dtype, bucket size in bytes, the engines' node key."""

    backend: ClassVar[str] = SHM_BACKEND
    dtype: str = "float32"
    bucket_size_bytes: int = 1 << 26
    node_key: str = "local"


class SharedMemoryTrainerEngine(TrainerWeightTransferEngine):
    """Trainer side of ``mgigpo_shm`` (one node): pack each bucket into a pooled shared-memory file, send its path,
    layout and per-tensor digests; then the commit; on any error the abort, and the error is raised."""

    init_info_cls = SharedMemoryTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender: bool = True, dtype: str = "float32",
                 bucket_size_bytes: int = 1 << 26, node_key: str = "local") -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.dtype, self.bucket_size_bytes, self.node_key = dtype_from_name(dtype), bucket_size_bytes, node_key
        self.pool = SharedMemoryPool()

    @classmethod
    def trainer_init(cls, init_info: SharedMemoryTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, dtype=init_info.dtype,
                     bucket_size_bytes=init_info.bucket_size_bytes, node_key=init_info.node_key)
        if engine.is_sender:
            engine.client.init_weight_transfer_engine({"dtype": init_info.dtype, "node_key": init_info.node_key})
        return engine

    def _buckets(self):
        bucket, size = [], 0
        for name, tensor in self.source:
            bucket.append((name, tensor))
            size += tensor.numel() * self.dtype.itemsize
            if size >= self.bucket_size_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def send_weights(self, weight_version: str | None = None) -> None:
        """One update: start, one ``update_weights`` per bucket, commit, finish with ``weight_version``.

        Raises:
            WeightSyncError (or the transport's error): after the engines dropped the update (abort + finish
                without a version), so they serve their previous weights.
        """
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        self.client.start_weight_update()
        digests: dict[str, bytes] = {}
        try:
            for bucket in self._buckets():
                shm = self.pool.acquire(sum(_aligned_nbytes(t, self.dtype) for _, t in bucket) or 64)
                flat, layout = pack_bucket(bucket, self.dtype, out=shm.buffer)
                views = unpack_bucket(flat, layout)
                bucket_digests = [tensor_digest(name, view) for name, view in views]
                digests.update({name: d for (name, _), d in zip(views, bucket_digests)})
                self.client.update_weights({"paths": {self.node_key: shm.path}, "layout": layout.to_wire(),
                                            "digests": [d.hex() for d in bucket_digests]})
            self.client.update_weights({"commit": combine_digests(digests)})
            self.client.finish_weight_update(weight_version)
        except BaseException as exc:
            self._abort(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.pool.release_all()

    def _abort(self, reason: str) -> None:
        """Every worker drops the update; a worker whose ``update_weights`` raised has already ended it, so it may
        refuse both calls: those errors are logged, the sync's own error is raised."""
        for call, arg in ((self.client.update_weights, {"abort": reason}), (self.client.finish_weight_update, None)):
            try:
                call(arg)
            except Exception as exc:  # noqa: BLE001 - must not hide the sync's error
                log.warning("weight update abort: %s", exc)

    def shutdown(self) -> None:
        self.pool.close()


def _aligned_nbytes(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    n = tensor.numel() * dtype.itemsize
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
