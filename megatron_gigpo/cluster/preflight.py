"""Preflight: compare what a recipe needs with what this machine / Ray cluster has, before anything starts.

:func:`megatron_gigpo.config.validate_config` checks a recipe on its own; this module checks it against
the world: devices, nodes, the model files, data directories and the retriever service. Every problem is
collected and reported at once in a :class:`PreflightError`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megatron_gigpo.models.config import ModelConfig
from megatron_gigpo.run.config import TrainerConfig


class CheckedRecipe(Protocol):
    """What the preflight reads of a recipe (:class:`megatron_gigpo.config.Config` is one): ``trainer`` (devices,
    nodes), ``model`` (its files), ``env`` (the whole section: its data and services), and the sections the
    placement plan reads (:class:`megatron_gigpo.cluster.placement.RecipeLayout`)."""

    trainer: TrainerConfig
    model: ModelConfig
    env: Any


class PreflightError(RuntimeError):
    """The recipe cannot run here; the message lists every missing resource and how to get it."""


def expand(path: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(path)))


def _check_model(cfg: CheckedRecipe) -> list[str]:
    path = cfg.model.path
    if path.startswith("builtin:"):
        from megatron_gigpo.models.builtin import BUILTIN_MODELS

        name = path.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            return [f"model.path '{path}': unknown builtin model; known: {', '.join(BUILTIN_MODELS)}"]
        if cfg.model.init == "pretrained" and getattr(BUILTIN_MODELS[name], "config_only", False):
            return [f"model.path '{path}' has no weights (a base for model.init: random only); set model.init: random"]
        return BUILTIN_MODELS[name].check()
    local = expand(path)
    if not (local / "config.json").is_file():
        from megatron_gigpo.models.hub import ModelNotCachedError, hub_snapshot, is_hub_id

        if not is_hub_id(path):
            return [f"model.path '{path}' is not a local Hugging Face directory with config.json ({local}), a "
                    f"Hugging Face hub id (Org/Name) or a builtin: model"]
        try:  # the check on the allocation never downloads (train does, where allowed, before it starts)
            local = hub_snapshot(path, cfg.model.revision, download=False)
        except ModelNotCachedError as exc:
            return [str(exc)]
        if not (local / "config.json").is_file():
            return [f"model.path '{path}': its cached snapshot {local} has no config.json"]
    if cfg.model.init == "pretrained" and not list(local.glob("*.safetensors")):  # random: config + tokenizer
        return [f"model.path '{path}': no *.safetensors weights in {local}"]
    return []


@dataclass(frozen=True)
class Allocation:
    """The machines a job was given (a Slurm allocation: ``sbatch --nodes`` and ``--gpus-per-node``), before any
    Ray cluster exists on them."""

    nodes: int
    gpus_per_node: int


def allocation_errors(cfg: CheckedRecipe, alloc: Allocation) -> list[str]:
    """Why ``cfg`` does not fit ``alloc`` exactly: the recipe's ``trainer.nnodes`` against the nodes, and on GPU
    ``trainer.devices_per_node`` (the GPUs its placement plan takes on each node) against the GPUs per node. A
    node or GPU the recipe leaves unused is refused too (it would idle for the whole job), as is one it needs
    but lacks (the run would wait ``trainer.timeouts.placement_s`` for it, then fail). On CPU the GPUs are not
    compared. Each message names the recipe keys and the ``sbatch`` options that make the two agree."""
    t = cfg.trainer
    gpu = t.device == "cuda"
    have = f"--nodes={alloc.nodes}" + (f" --gpus-per-node={alloc.gpus_per_node}" if gpu else "")
    want = f"--nodes={t.nnodes}" + (f" --gpus-per-node={t.devices_per_node}" if gpu else "")
    recipe = f"trainer.nnodes={t.nnodes}" + (f" x trainer.devices_per_node={t.devices_per_node} GPUs" if gpu else "")
    problems = []
    if alloc.nodes != t.nnodes:
        problems.append(f"{alloc.nodes - t.nnodes} node(s) would idle" if alloc.nodes > t.nnodes
                        else f"{t.nnodes - alloc.nodes} node(s) are missing")
    if gpu and alloc.gpus_per_node != t.devices_per_node:
        problems.append(f"{alloc.gpus_per_node - t.devices_per_node} GPU(s) per node would idle"
                        if alloc.gpus_per_node > t.devices_per_node else
                        f"{t.devices_per_node - alloc.gpus_per_node} GPU(s) per node are missing")
    if not problems:
        return []
    fix = f"trainer.nnodes={alloc.nodes}" + (f" trainer.devices_per_node={alloc.gpus_per_node}" if gpu else "")
    return [f"the allocation ({have}) does not match the recipe ({recipe}): {' and '.join(problems)}. Submit with "
            f"`sbatch {want}`, or set {fix} (parallel.data_parallel_size and rollout.num_engines: auto follow "
            f"the world size)"]


def _check_devices(cfg: CheckedRecipe, cluster_resources: dict[str, float] | None,
                   allocation: Allocation | None = None) -> list[str]:
    from megatron_gigpo.cluster.placement import plan_placement

    if allocation is not None:  # a job's nodes before Ray starts on them: compared with the recipe, not counted
        return allocation_errors(cfg, allocation)
    t = cfg.trainer
    if t.device == "cpu":
        return []
    needed = plan_placement(cfg).total_gpus  # what the run reserves (validate_config made sure it fits)
    if cluster_resources is not None:
        have = int(cluster_resources["GPU"]) if "GPU" in cluster_resources else 0
        where = "the Ray cluster"
    else:
        import torch

        have = torch.cuda.device_count() if t.nnodes == 1 else 0
        where = "this machine" if t.nnodes == 1 else "this machine (multi-node recipes need a Ray cluster: RAY_ADDRESS)"
    if have < needed:
        return [
            f"trainer.device=cuda needs {needed} GPUs (its placement plan on trainer.nnodes={t.nnodes} x "
            f"trainer.devices_per_node={t.devices_per_node}; `validate --plan` shows it) but {where} has {have}; "
            f"run on a GPU allocation (slurm/train.sbatch) or use trainer.device=cpu"
        ]
    return []


def preflight(cfg: CheckedRecipe, cluster_resources: dict[str, float] | None = None, *, check_env: bool = True,
              allocation: Allocation | None = None) -> None:
    """Check devices, model files, data directories and services for ``cfg``.

    Args:
        cfg: a validated config.
        cluster_resources: ``ray.cluster_resources()`` when a Ray cluster is already connected, else None
            (local devices are counted).
        check_env: also check the environment's data and services (False for ``sft``, which runs none).
        allocation: the job's nodes and GPUs per node (``validate --nodes --gpus-per-node``, from the sbatch
            script before Ray starts): the devices are checked against it (:func:`allocation_errors`) instead
            of counted.

    Raises:
        PreflightError: listing every problem found.
    """
    from megatron_gigpo.envs.registry import check_env_resources

    problems = _check_devices(cfg, cluster_resources, allocation)
    problems += _check_model(cfg)
    if check_env:
        problems += check_env_resources(cfg.env)
    if problems:
        raise PreflightError("preflight failed:\n  - " + "\n  - ".join(problems))


def check_allocation(cfg: CheckedRecipe, allocation: Allocation) -> None:
    """:func:`allocation_errors` alone (``validate --nodes --gpus-per-node`` without ``--preflight``).

    Raises:
        PreflightError: the allocation does not match the recipe.
    """
    problems = allocation_errors(cfg, allocation)
    if problems:
        raise PreflightError("allocation check failed:\n  - " + "\n  - ".join(problems))
