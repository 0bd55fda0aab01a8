"""Actor checkpoints with Megatron ``dist_checkpointing``: model, optimizer, LR schedule, RNG and trainer state.

The layout under a checkpoint root and the helpers that find checkpoints are in
:mod:`megatron_gigpo.actor.checkpoint_layout` (torch-free, for the driver). A checkpoint is written into ``<name>.tmp``; after every rank has finished, global rank 0 writes
``meta.json`` (iteration, parallel layout) and renames the folder to its final name. A folder is complete when
its name has no suffix and it holds ``meta.json``. Only the ``keep_last`` newest complete checkpoints are kept.
The root must be on a file system every rank sees (as Megatron-LM requires).

Model and optimizer tensors are saved as global sharded tensors, so a checkpoint saved at one (TP, PP, DP)
loads at another (Megatron resharding). RNG states are per (PP, TP, DP) rank and are restored only when the
layout is unchanged. Upstream API: megatron-core 0.16 ``dist_checkpointing.save/load``,
``MegatronModule.sharded_state_dict``, ``MegatronOptimizer.sharded_state_dict``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import unwrap_model

from megatron_gigpo.actor.checkpoint_layout import (
    META_FILE,
    checkpoint_name,
    complete_checkpoints,
    fsync_dir,
    resolve_checkpoint,
    write_json_atomic,
)

__all__ = [
    "save_actor_checkpoint",
    "load_actor_checkpoint",
    "CheckpointState",
]


def _optimizer_metadata() -> dict[str, Any]:
    """``sharded_state_dict`` metadata for Megatron's optimizers.

    DistributedOptimizer state is gathered into canonical per-parameter tensors ("fully_reshardable"),
    reshardable across TP, PP and DP ("fully_sharded_model_space" relies on ShardedTensor.flattened_range,
    which this dist_checkpointing rejects). Without CUDA the gather must use the gloo data-parallel group
    (the "mem_efficient" variant; the default all-gathers with NCCL on the GPU).
    """
    return {
        "distrib_optim_sharding_type": "fully_reshardable",
        "distrib_optim_fully_reshardable_mem_efficient": not torch.cuda.is_available(),
    }


def layout() -> dict[str, int]:
    """This run's parallel layout as saved in ``meta.json``."""
    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
    }


def _rng_state() -> dict[str, Any]:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(data: Any) -> ShardedObject:
    pp, tp, dp = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_data_parallel_world_size(),
    )
    offset = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    )
    return ShardedObject("rng_state", data, (pp, tp, dp), offset, replica_id=0)


class CheckpointState:
    """What one rank saves: model chunk, optimizer, LR scheduler and small actor / trainer dicts.

    ``adapters_only``: a LoRA actor (:mod:`.lora`) saves and loads only the adapter tensors of the model (the
    frozen base comes from ``model_path``; the optimizer holds only adapters anyway)."""

    def __init__(self, model_chunks, optimizer, scheduler, *, adapters_only: bool = False) -> None:
        if len(model_chunks) != 1:
            raise ValueError(f"checkpointing supports one model chunk per rank, got {len(model_chunks)}")
        self.model = unwrap_model(model_chunks[0])
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.adapters_only = adapters_only

    def load_model_state(self, state: dict[str, Any]) -> None:
        if self.adapters_only:
            from megatron_gigpo.actor.lora_files import load_adapter_state

            load_adapter_state(self.model, state)
        else:
            self.model.load_state_dict(state)

    def sharded_state_dict(self, *, is_loading: bool, with_rng: bool) -> dict[str, Any]:
        if self.adapters_only:
            from megatron_gigpo.actor.lora_files import adapter_sharded_state_dict

            model_sd = adapter_sharded_state_dict(self.model)
        else:
            model_sd = self.model.sharded_state_dict()
        state = {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=_optimizer_metadata()
            ),
            "opt_param_scheduler": self.scheduler.state_dict(),
        }
        if with_rng:
            state["rng_state"] = _rng_sharded_object(_rng_state())
        return state


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def save_actor_checkpoint(
    root: str | Path,
    iteration: int,
    state: CheckpointState,
    *,
    actor_state: dict[str, Any],
    trainer_state: dict[str, Any],
    keep_last: int,
    model_sidecar: Callable[[Path], None] | None = None,
) -> Path:
    """Save a complete checkpoint of ``iteration`` atomically; collective over all ranks.

    Args:
        root: checkpoint root (created if missing).
        iteration: training iteration the checkpoint follows (the folder name).
        state: what this rank saves.
        actor_state: small picklable dict (update counters), identical on all ranks.
        trainer_state: the driver's picklable dict (iteration, data position, ...), identical on all ranks.
        keep_last: complete checkpoints kept after this one is in place (>= 1).
        model_sidecar: called on rank 0 with the staging folder before it is renamed into place (the HF
            sidecar that makes the checkpoint convertible, :func:`megatron_gigpo.models.checkpoint.write_model_sidecar`).

    Returns:
        The final folder ``root/iter_XXXXXXXX``.

    Raises:
        ValueError: ``keep_last < 1``.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    root = Path(root)
    final = root / checkpoint_name(iteration)
    tmp = root / (final.name + ".tmp")
    rank0 = dist.get_rank() == 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        _remove(tmp)
        tmp.mkdir()
    dist.barrier()
    sharded = state.sharded_state_dict(is_loading=False, with_rng=True)
    sharded["actor_state"] = actor_state
    sharded["trainer_state"] = trainer_state
    dist_checkpointing.save(sharded, str(tmp))
    dist.barrier()
    if rank0:
        if model_sidecar is not None:
            model_sidecar(tmp)
        write_json_atomic(tmp / META_FILE, {"iteration": iteration, "layout": layout()})
        if final.exists():  # re-saving an iteration (e.g. after a resume): the new copy wins
            _remove(final)
        os.replace(tmp, final)
        fsync_dir(root)
        for _, old in complete_checkpoints(root)[:-keep_last]:
            _remove(old)
        for stale in root.glob("iter_*.tmp"):  # left by saves that crashed
            _remove(stale)
    dist.barrier()
    return final


def load_actor_checkpoint(root: str | Path, state: CheckpointState, *,
                          check_folder: Callable[[Path], None] | None = None) -> dict[str, Any] | None:
    """Load ``root`` (one checkpoint folder, or the newest complete one under it, see
    :func:`~megatron_gigpo.actor.checkpoint_layout.resolve_checkpoint`) into ``state``; collective over all ranks.

    Model weights, optimizer state (including each parameter's Adam ``step``, see
    :func:`_load_optimizer_state`) and the LR schedule are restored at any layout; RNG states only when
    TP, PP and DP are the sizes the checkpoint was saved with.

    ``check_folder`` is called with the chosen folder on every rank before anything is read (it raises to
    refuse the checkpoint, e.g. a LoRA checkpoint of another base).

    Returns:
        ``{"iteration", "actor_state", "trainer_state", "rng_restored"}`` or None when there is no complete
        checkpoint.
    """
    found = resolve_checkpoint(root) if dist.get_rank() == 0 else None
    box = [None if found is None else (found[0], str(found[1]))]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return None
    iteration, folder = box[0]
    if check_folder is not None:
        check_folder(Path(folder))
    meta = json.loads((Path(folder) / META_FILE).read_text())
    same_layout = meta["layout"] == layout()
    _allocate_distributed_optimizer_state(state.optimizer)
    sharded = state.sharded_state_dict(is_loading=True, with_rng=same_layout)
    loaded = dist_checkpointing.load(sharded, folder)
    state.load_model_state(loaded["model"])
    _load_optimizer_state(state.optimizer, loaded["optimizer"])
    state.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    return {
        "iteration": iteration,
        "actor_state": loaded["actor_state"],
        "trainer_state": loaded["trainer_state"],
        "rng_restored": same_layout,
    }


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _allocate_distributed_optimizer_state(optimizer) -> None:
    """Give a fresh DistributedOptimizer zero Adam state before its loading state dict is built.

    Without Apex / Transformer-Engine, ``DistributedOptimizer.state_dict`` reads every parameter's ``step``
    (and asserts they agree) even when preparing a load, which fails on an optimizer that has not stepped
    yet. Zero ``step`` / ``exp_avg`` / ``exp_avg_sq`` are allocated (the load overwrites them); no optimizer
    step is taken, so weights are untouched.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in _inner_optimizers(optimizer):
        if not isinstance(opt, DistributedOptimizer):
            continue
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                param_state = opt.optimizer.state[param]
                if not param_state:
                    param_state["step"] = torch.tensor(0.0)
                    param_state["exp_avg"] = torch.zeros_like(param)
                    param_state["exp_avg_sq"] = torch.zeros_like(param)


def _load_optimizer_state(optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict`` with each parameter's Adam ``step`` restored exactly.

    Without Apex / Transformer-Engine (torch ``Adam``), ``DistributedOptimizer.load_state_dict`` first gives
    every parameter one *shared* ``step`` tensor (torch's Adam then increments it once per parameter per
    step, corrupting every bias correction), and its "fully_reshardable" parameter loader then fails on the
    ``step`` key it finds in the live state but never saves. So for a DistributedOptimizer the non-tensor
    part is loaded first, the ``step`` entries are set aside while the parameter state is loaded, and every
    parameter gets its own copy back. Other optimizers restore per-parameter steps themselves
    (``_restore_common_per_param_step`` deep-copies).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = _inner_optimizers(optimizer)
    parts = [state_dict] if len(inner) == 1 else [v for _, v in sorted(state_dict.items())]
    if len(parts) != len(inner):
        raise ValueError(f"checkpoint has {len(parts)} optimizer states, the optimizer has {len(inner)}")
    for opt, part in zip(inner, parts):
        if not isinstance(opt, DistributedOptimizer) or "param_state" not in part:
            opt.load_state_dict(part)
            continue
        part = dict(part)
        param_state = part.pop("param_state")
        sharding_type = part.pop("param_state_sharding_type")
        if sharding_type != "fully_reshardable":
            raise ValueError(f"unsupported DistributedOptimizer checkpoint format {sharding_type!r}")
        opt.load_state_dict(part)  # param groups, grad scaler, (shared) step
        steps = {param: st.pop("step") for param, st in opt.optimizer.state.items() if "step" in st}
        opt.load_parameter_state_from_fully_reshardable(param_state)
        for param, step in steps.items():
            opt.optimizer.state[param]["step"] = step.detach().clone()
    if len(inner) > 1:
        optimizer._synchronize_steps()
