"""torch.distributed + Megatron model-parallel state for one actor process.

One call, :func:`initialize`, brings a process launched by ``torchrun``, Ray or a test harness (environment
variables ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; optional ``LOCAL_RANK``) to the point
where megatron-core models can be built: default process group (NCCL on CUDA, gloo on CPU), the CPU
compatibility layer when there is no GPU, ``parallel_state.initialize_model_parallel`` and the model-parallel
RNG (``tensor_parallel.model_parallel_cuda_manual_seed``). Upstream API: megatron-core 0.16
``megatron.core.parallel_state``.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_gigpo.actor import cpu_compat

__all__ = ["initialize", "destroy", "device", "is_initialized"]

_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_OWNS_PROCESS_GROUP = False


def device() -> torch.device:
    """The device this rank computes on: ``cuda:<current>`` when CUDA is available, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_initialized() -> bool:
    """True when both torch.distributed and Megatron's model-parallel groups are set up."""
    return dist.is_initialized() and parallel_state.model_parallel_is_initialized()


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _init_process_group(backend: str | None, timeout_s: float) -> None:
    global _OWNS_PROCESS_GROUP
    missing = [name for name in _REQUIRED_ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"torch.distributed is not initialized and environment variables {missing} are missing; "
            "launch with torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
        )
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if torch.cuda.is_available():
        local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _OWNS_PROCESS_GROUP = True


def initialize(
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    *,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    seed: int = 1234,
    backend: str | None = None,
    timeout_s: float = 1800.0,
) -> None:
    """Initialise torch.distributed (if needed) and Megatron's model-parallel groups and RNG.

    Args:
        tensor_model_parallel_size: TP degree; must divide the world size.
        pipeline_model_parallel_size: PP degree; TP * PP must divide the world size, the rest is DP.
        virtual_pipeline_model_parallel_size: interleaved-pipeline chunks per rank, or None.
        expert_model_parallel_size: EP degree (mixture-of-experts layers: each EP rank holds experts / EP of
            them); expert TP x EP x PP must divide the world size (megatron-core's expert groups).
        expert_tensor_parallel_size: TP degree of the experts' linear layers; None: megatron-core's default,
            ``tensor_model_parallel_size``.
        seed: base seed. As in Megatron-LM's ``_set_random_seed``, each pipeline stage uses
            ``seed + 100 * pp_rank`` for the CPU generator; the model-parallel RNG tracker then derives
            its TP/DP streams from that (``model_parallel_cuda_manual_seed``).
        backend: torch.distributed backend; default ``nccl`` with CUDA, ``gloo`` without.
        timeout_s: collective timeout in seconds (process group and Megatron's groups).

    Raises:
        RuntimeError: torch.distributed is not initialised and the launcher variables are missing, or
            model-parallel state already exists with other sizes.
        ValueError: the world size is not divisible by TP * PP.
    """
    if not dist.is_initialized():
        _init_process_group(backend, timeout_s)
    if not torch.cuda.is_available():
        cpu_compat.enable()

    world_size = dist.get_world_size()
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size
    if tensor_model_parallel_size < 1 or pipeline_model_parallel_size < 1 or world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size "
            f"{tensor_model_parallel_size} x pipeline_model_parallel_size {pipeline_model_parallel_size}"
        )
    expert_tp = tensor_model_parallel_size if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    expert_parallel = expert_tp * expert_model_parallel_size * pipeline_model_parallel_size
    if expert_model_parallel_size < 1 or expert_tp < 1 or world_size % expert_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by expert_tensor_parallel_size {expert_tp} x "
            f"expert_model_parallel_size {expert_model_parallel_size} x pipeline_model_parallel_size "
            f"{pipeline_model_parallel_size}"
        )
    if parallel_state.model_parallel_is_initialized():
        current = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
        requested = (tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size, expert_tp)
        if current != requested:
            raise RuntimeError(
                f"Megatron model parallel is already initialised with (TP, PP, EP, expert TP) = {current}, "
                f"requested {requested}; call destroy() first"
            )
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
            expert_tensor_parallel_size=expert_tp,
            distributed_timeout_minutes=max(1, int(round(timeout_s / 60))),
        )
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


def destroy(*, process_group: bool = True) -> None:
    """Tear down Megatron's model-parallel state.

    Args:
        process_group: also destroy the default process group if :func:`initialize` created it. Pass
            False to re-:func:`initialize` with another TP/PP layout in the same processes (a new default
            group cannot reuse the launcher's ``MASTER_PORT``).
    """
    global _OWNS_PROCESS_GROUP
    parallel_state.destroy_model_parallel()
    if process_group and _OWNS_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
        _OWNS_PROCESS_GROUP = False
