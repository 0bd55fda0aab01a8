"""Run megatron-core on a CPU-only torch build (gloo), for CI and laptops.

megatron-core assumes CUDA in a handful of places that no configuration switch turns off. ``enable()``
maps exactly those to the CPU; everything that megatron *does* let us configure is configured instead
(``TransformerConfig.use_cpu_initialization=True``, ``DistributedDataParallelConfig`` with one
distributed-optimizer instance so no CUDA streams are created, ``TransformerConfig.enable_autocast=False``)
by the code that builds those configs.

What ``enable()`` changes (call sites are megatron-core 0.16.1, ``megatron/core/...``):

1. ``torch.cuda.current_device()`` returns ``torch.device("cpu")``. Megatron passes it as ``device=`` when
   it allocates buffers: RoPE ``inv_freq`` (models/common/embeddings/rotary_pos_embedding.py:162, moved
   at every forward regardless of ``use_cpu_initialization``), DDP grad/param buffers
   (distributed/param_and_grad_buffer.py:783-806), pipeline receive buffers
   (pipeline_parallel/p2p_communication.py:190-321), the distributed optimizer's shard buffers
   (optimizer/distrib_optimizer.py:791), ``ChainedOptimizer.get_loss_scale`` (optimizer/optimizer.py:1141).
2. ``torch.cuda.synchronize()`` is a no-op (CPU kernels are synchronous): after batched p2p ops
   (pipeline_parallel/p2p_communication.py:242,398) and in parallel_state.py:198.
3. RNG: the model-parallel RNG tracker (tensor_parallel/random.py: ``CudaRNGStatesTracker.add`` :235-240,
   ``fork`` :250-277, ``model_parallel_cuda_manual_seed`` :422) saves/restores "CUDA" generator states,
   and ``DotProductAttention.forward`` always enters ``get_cuda_rng_tracker().fork()``. We back
   ``torch.cuda.{get,set}_rng_state`` / ``torch.cuda.manual_seed`` and megatron's
   ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` with the CPU default generator, so the tracker keeps
   per-TP-rank dropout streams exactly as it does on GPUs. Because the tracker's generator now *is* the
   CPU generator, ``fork``'s "CPU RNG state changed within GPU RNG context" warning (random.py:262) is
   always a false alarm here; a logging filter drops that one message.
4. A few functions create tensors with a hard-coded ``device='cuda'`` or compare ``Tensor.type()`` with
   ``'torch.cuda.FloatTensor'``. Only these functions are wrapped so that, *while they run*, a
   ``TorchFunctionMode`` rewrites ``device='cuda'`` to the CPU, makes ``Tensor.cuda()`` a no-op and (for
   the type checks) reports CPU tensor types with the ``torch.cuda.`` prefix:

   - ``optimizer.optimizer.MixedPrecisionOptimizer.__init__`` (optimizer.py:473-485, device='cuda')
   - ``optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__`` (optimizer.py:671-700, type())
   - ``optimizer.optimizer.FP32Optimizer.__init__`` (optimizer.py:907, device='cuda')
   - ``optimizer.distrib_optimizer.DistributedOptimizer.__init__`` (distrib_optimizer.py:361,420,582,
     type())
   - ``optimizer.clip_grads.get_grad_norm_fp32`` / ``clip_grad_by_total_norm_fp32`` /
     ``count_zeros_fp32`` (clip_grads.py:90-207, device='cuda' and grad.type()), rebound where
     optimizer.py and layer_wise_optimizer.py imported them by name
   - ``models.common.language_module.language_module.LanguageModule.setup_embeddings_and_output_layer``
     (language_module.py:244, ``weight.data.cuda()`` before the tied-embedding all-reduce when PP > 1)
   - ``transformer.utils.get_default_causal_mask`` / ``get_sliding_window_causal_mask`` (utils.py:35-40,
     device="cuda"; rebound in fusions/fused_softmax.py): run again in the backward pass when activations are
     recomputed (``recompute_granularity``), where the schedules' scope is not active (a mode is off while its own
     handler runs, and the mode intercepts ``torch.autograd.backward``), so they get a scope of their own
   - ``pipeline_parallel.schedules.forward_backward_no_pipelining`` /
     ``forward_backward_pipelining_without_interleaving`` / ``..._with_interleaving``
     (schedules.py:596,983,2138, device="cuda" for ``total_num_tokens``); device rewrite only, the model's
     own ``Tensor.type()`` is left alone. ``get_forward_backward_func`` looks these names up at call time.

5. Without Transformer-Engine, ``transformer.moe.moe_utils`` leaves ``te_general_gemm`` undefined (it is bound only
   inside the module's ``try: import transformer_engine``), yet ``RouterGatingLinearFunction.forward`` /
   ``backward`` (moe_utils.py:1192,1225) test ``te_general_gemm is not None``: every MoE router raises
   ``NameError``. :func:`define_missing_te_names` binds it to None, so the router takes its own ``torch.mm``
   branch. Not CPU-specific (a CUDA machine without TE has the same bug), so the model builder calls it for MoE
   models whatever the device; ``enable()`` calls it too.

6. ``transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher`` (the only dispatcher megatron-core allows with
   ``variable_seq_lengths``, which pipeline parallelism needs here) creates a class-wide ``torch.cuda.Stream()`` in
   its constructor (token_dispatcher.py:444) and, in ``_maybe_dtoh_and_synchronize`` (:862-900), copies the routing
   counts to the host on that stream, records an event and later waits on it. On the CPU the counts already are host
   tensors: the stream slot is filled with a placeholder before any dispatcher is built, and the method is replaced
   by :func:`_host_splits`, which makes the same conversions (the splits to numpy arrays, as the GPU path leaves
   them) with no stream and no event.

Not covered (GPU-only features, unsupported on CPU anyway): fp16 loss scaling (optimizer/grad_scaler.py),
CUDA graphs, NCCL userbuffers, multiple distributed-optimizer instances, the fully-parallel
dist_checkpointing exchange (dist_checkpointing/exchange_utils.py).

Nothing happens at import; ``enable()`` is explicit, idempotent and a no-op when CUDA is available.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

__all__ = ["enable", "is_enabled", "cpu_device_scope", "define_missing_te_names"]

_ENABLED = False


def is_enabled() -> bool:
    """True once :func:`enable` has patched this process."""
    return _ENABLED


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    # An int device is a CUDA ordinal in torch's factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device='cuda'`` to CPU and ``Tensor.cuda()`` to identity while active.

    With ``fake_cuda_type=True`` also makes ``tensor.type()`` (no arguments) answer
    ``'torch.cuda.FloatTensor'`` etc. for CPU tensors, which megatron's optimizers require.
    """

    def __init__(self, fake_cuda_type: bool) -> None:
        super().__init__()
        self.fake_cuda_type = fake_cuda_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if self.fake_cuda_type and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def cpu_device_scope(fn: Callable, *, fake_cuda_type: bool) -> Callable:
    """Wrap ``fn`` so it runs under the CUDA->CPU rewrite (see module docstring, item 4).

    Nested wrapped calls reuse an outer scope that is active on torch's mode stack; an inner type-faking call
    still gets type faking.
    """
    if getattr(fn, "_megatron_gigpo_cpu_scope", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # The innermost scope that is really on torch's mode stack: a mode is off while its own handler runs
        # (e.g. during ``torch.autograd.backward``, which the mode intercepts), so a scope entered before that
        # handler does not cover what the backward pass calls (activation recomputation).
        active = [m for m in _get_current_function_mode_stack() if isinstance(m, _CudaToCpuMode)]
        if active and (active[-1].fake_cuda_type or not fake_cuda_type):
            return fn(*args, **kwargs)
        with _CudaToCpuMode(fake_cuda_type):
            return fn(*args, **kwargs)

    wrapper._megatron_gigpo_cpu_scope = True
    return wrapper


# (module, attribute path, fake Tensor.type()?, modules that imported the name and need rebinding)
_SCOPED_CALLS: tuple[tuple[str, str, bool, tuple[str, ...]], ...] = (
    ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.__init__", True, ()),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__", True, ()),
    ("megatron.core.optimizer.optimizer", "FP32Optimizer.__init__", True, ()),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__", True, ()),
    (
        "megatron.core.optimizer.clip_grads",
        "get_grad_norm_fp32",
        True,
        ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.layer_wise_optimizer"),
    ),
    (
        "megatron.core.optimizer.clip_grads",
        "clip_grad_by_total_norm_fp32",
        True,
        ("megatron.core.optimizer.optimizer",),
    ),
    (
        "megatron.core.optimizer.clip_grads",
        "count_zeros_fp32",
        True,
        ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.layer_wise_optimizer"),
    ),
    (
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule.setup_embeddings_and_output_layer",
        False,
        (),
    ),
    # called again in the backward pass when activations are recomputed (recompute_granularity)
    ("megatron.core.transformer.utils", "get_default_causal_mask", False, ("megatron.core.fusions.fused_softmax",)),
    ("megatron.core.transformer.utils", "get_sliding_window_causal_mask", False,
     ("megatron.core.fusions.fused_softmax",)),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining", False, ()),
    (
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_pipelining_without_interleaving",
        False,
        (),
    ),
    (
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_pipelining_with_interleaving",
        False,
        (),
    ),
)


def _wrap_scoped_calls() -> None:
    for module_name, attr_path, fake_type, rebind_in in _SCOPED_CALLS:
        module = importlib.import_module(module_name)
        owner_name, _, attr = attr_path.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        original = getattr(owner, attr)
        wrapped = cpu_device_scope(original, fake_cuda_type=fake_type)
        setattr(owner, attr, wrapped)
        for other_name in rebind_in:
            other = importlib.import_module(other_name)
            if getattr(other, attr, None) is original:
                setattr(other, attr, wrapped)


def _map_cuda_rng_to_cpu() -> None:
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)

    def _get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()  # already a copy

    def _set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_state
    mrandom._set_cuda_rng_state = _set_state
    logging.getLogger(mrandom.__name__).addFilter(_DropCpuRngWarning())


class _DropCpuRngWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "CPU RNG state changed within GPU RNG context"


def _host_splits(self, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` on the CPU (module docstring, item 6)."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _patch_alltoall_dispatcher() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "no CUDA stream on the CPU"
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _host_splits


def define_missing_te_names() -> None:
    """Bind ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` to None when Transformer-Engine is absent
    (module docstring, item 5). Idempotent; leaves a real binding alone."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def enable() -> None:
    """Make megatron-core usable on this CPU-only process (see the module docstring for every patch).

    Idempotent. Does nothing when ``torch.cuda.is_available()``. Call it before building models,
    DDP wrappers or optimizers (``megatron_gigpo.actor.distributed.initialize`` does).
    """
    global _ENABLED
    if _ENABLED or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    _map_cuda_rng_to_cpu()
    _wrap_scoped_calls()
    define_missing_te_names()
    _patch_alltoall_dispatcher()
    _ENABLED = True
