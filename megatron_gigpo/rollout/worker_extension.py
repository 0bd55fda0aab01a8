"""vLLM worker extension: what vLLM 0.32's weight-transfer protocol lacks on the worker.

Passed to vLLM as ``LLM(..., worker_extension_cls="megatron_gigpo.rollout.worker_extension.
WeightSyncWorkerExtension")``; vLLM mixes the class into its worker (``vllm.v1.worker.cpu_worker.CPUWorker``
or the GPU ``Worker``), so ``self`` is the worker and the methods are called through
``LLM.collective_rpc("weight_transfer_...")`` on every worker (every TP rank) of one engine. The transfer itself
(receive, check, stage, load) is the worker's ``weight_transfer_engine``, one of our backends
(:mod:`megatron_gigpo.rollout.transfer`).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["WeightSyncWorkerExtension"]


class WeightSyncWorkerExtension:
    """Methods mixed into each vLLM worker (they must not shadow the worker's own: vLLM asserts that)."""

    def weight_transfer_info(self) -> dict[str, Any]:
        """``{"pid": int, "engine": str | None, "error": str | None}``: this worker's process id, the class name of
        its vLLM weight-transfer engine (None when the engine was started without ``weight_transfer_config``) and
        the current update's first error (``StagedWeightTransfer.error``: our backends keep a refused chunk's
        error instead of raising it; None: none)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return {"pid": os.getpid(), "engine": None if engine is None else type(engine).__name__,
                "error": getattr(engine, "error", None)}

    def weight_transfer_abort(self) -> None:
        """Drop a weight update on this worker; the model keeps its weights (idempotent, never loads).

        vLLM has no abort: a worker whose ``update_weights`` raised has ended its session, its peers have not
        (vLLM's private ``Worker._weight_update_active``). Here the backend drops its staging and the update's
        error (``StagedWeightTransfer.reset``), then a session still open is ended with vLLM's
        ``finish_weight_update``, which loads nothing once nothing is committed.
        """
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            return
        reset = getattr(engine, "reset", None)
        if reset is not None:
            reset()
        if getattr(self, "_weight_update_active", False):
            self.finish_weight_update()
