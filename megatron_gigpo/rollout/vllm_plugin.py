"""Our weight-transfer backends, registered with vLLM's factories in every process that starts an engine.

vLLM 0.32 (``vllm.distributed.weight_transfer``) builds one ``WeightTransferEngine`` per worker from
``LLM(weight_transfer_config=WeightTransferConfig(backend=...))`` through ``WeightTransferEngineFactory``, and the
trainer side through ``WeightTransferTrainerFactory``. Our backends (``megatron_gigpo.rollout.transfer``):

========================  ==================================  =========================================
backend                   engine side (worker)                trainer side
========================  ==================================  =========================================
``mgigpo_shm``  (CPU)     ``cpu_engines:SharedMemory...``     ``cpu_trainers:SharedMemoryTrainerEngine``
``mgigpo_gloo`` (CPU)     ``cpu_engines:Gloo...``             ``cpu_trainers:GlooTrainerEngine``
``mgigpo_ipc``  (CUDA)    ``cuda_engines:StagedIPC...``       vLLM's ``ipc``
``mgigpo_nccl`` (CUDA)    ``cuda_engines:StagedNCCL...``      vLLM's ``nccl``
========================  ==================================  =========================================

:func:`register` is the ``vllm.general_plugins`` entry point of this package (pyproject.toml); vLLM's
``load_general_plugins`` runs it in the engine core, in each worker before it loads the model, and in
``EngineArgs``. The trainer process calls it itself. This module imports neither torch nor vLLM at import time
(the entry point runs in every vLLM process of the environment).
"""

from __future__ import annotations

import logging
import os

__all__ = [
    "SHM_BACKEND",
    "GLOO_BACKEND",
    "IPC_BACKEND",
    "NCCL_BACKEND",
    "BACKENDS",
    "CPU_BACKENDS",
    "ENTRY_POINT",
    "register",
    "entry_point_error",
]

SHM_BACKEND = "mgigpo_shm"
GLOO_BACKEND = "mgigpo_gloo"
IPC_BACKEND = "mgigpo_ipc"
NCCL_BACKEND = "mgigpo_nccl"
BACKENDS = (SHM_BACKEND, GLOO_BACKEND, IPC_BACKEND, NCCL_BACKEND)
CPU_BACKENDS = (SHM_BACKEND, GLOO_BACKEND)

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "megatron_gigpo"
ENTRY_POINT = f"{__name__}:register"

_PACKAGE = "megatron_gigpo.rollout.transfer"
_ENGINES = {
    SHM_BACKEND: (f"{_PACKAGE}.cpu_engines", "SharedMemoryWeightTransferEngine"),
    GLOO_BACKEND: (f"{_PACKAGE}.cpu_engines", "GlooWeightTransferEngine"),
    IPC_BACKEND: (f"{_PACKAGE}.cuda_engines", "StagedIPCWeightTransferEngine"),
    NCCL_BACKEND: (f"{_PACKAGE}.cuda_engines", "StagedNCCLWeightTransferEngine"),
}
_TRAINERS = {
    SHM_BACKEND: (f"{_PACKAGE}.cpu_trainers", "SharedMemoryTrainerEngine"),
    GLOO_BACKEND: (f"{_PACKAGE}.cpu_trainers", "GlooTrainerEngine"),
}

log = logging.getLogger(__name__)


def register() -> None:
    """Add our backends to ``WeightTransferEngineFactory`` and ``WeightTransferTrainerFactory`` (vLLM 0.32),
    lazily by module path (a backend's module is imported only when an engine of it is created).

    Idempotent (vLLM may load the plugins several times in one process) and never raises: without vLLM's
    weight-transfer subsystem (vLLM older than 0.32) it logs a warning and registers nothing.
    """
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )

        for factory, table in ((WeightTransferEngineFactory, _ENGINES), (WeightTransferTrainerFactory, _TRAINERS)):
            for name, (module, cls) in table.items():
                if name not in factory._registry:  # register_engine raises ValueError for a known name
                    factory.register_engine(name, module, cls)
    except Exception as exc:  # noqa: BLE001 - a plugin must not break every vLLM process of the environment
        log.warning("megatron_gigpo: vLLM weight-transfer backends not registered: %r", exc)


def entry_point_error() -> str | None:
    """Why vLLM's processes would not run :func:`register`, or None when they will.

    Checks that this package's ``vllm.general_plugins`` entry point is installed (``importlib.metadata``) and
    not filtered out by ``VLLM_PLUGINS``. The message names the fix (``pip install -e .``).
    """
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.value.replace(" ", "") == ENTRY_POINT]
    if not found:
        return (f"the vLLM plugin entry point {ENTRY_POINT_GROUP}: {ENTRY_POINT_NAME} = {ENTRY_POINT} is not "
                "installed, so vLLM's worker processes cannot find the weight-transfer backends "
                f"{', '.join(BACKENDS)}; reinstall: pip install -e .")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and found[0].name not in allowed.split(","):  # split as vllm.envs does
        return (f"VLLM_PLUGINS={allowed!r} leaves out the plugin {found[0].name!r} that registers the "
                f"weight-transfer backends {', '.join(BACKENDS)}; add it or unset VLLM_PLUGINS")
    return None
