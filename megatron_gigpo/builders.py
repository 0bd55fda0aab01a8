"""Everything the driver loop uses, built from a :class:`~megatron_gigpo.config.Config`.

:class:`RunContext` owns the run's lifetime: preflight, Ray, the Megatron actor ranks (placement group),
the vLLM rollout engines, the environment workers, the metric sinks and checkpoints. The driver only
calls its methods in order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from megatron_gigpo.config import Config, save_config
from megatron_gigpo.logs import ray_runtime_env

log = logging.getLogger(__name__)


def init_ray(cfg: Config) -> dict[str, float]:
    """Connect to ``RAY_ADDRESS`` (a cluster, e.g. from slurm/train.sbatch) or start a local Ray.

    Token authentication either way (:mod:`megatron_gigpo.cluster.ray_setup`): a local Ray gets a fresh token file
    that is removed when this process exits; a cluster needs the token that the environment provides.

    Returns ``ray.cluster_resources()``.
    Raises:
        RayAuthError: no token, a refused token, or a bad ``MEGATRON_GIGPO_RAY_AUTH``.
    """
    import atexit

    import ray

    from megatron_gigpo.cluster.ray_setup import connect_ray, local_ray_env

    if not ray.is_initialized():
        # Worker output: INFO to runs/<experiment>/logs/, warnings and errors to the terminal (megatron_gigpo.logs).
        runtime_env = ray_runtime_env(cfg.run_dir / "logs")
        if "RAY_ADDRESS" in os.environ:
            connect_ray(os.environ["RAY_ADDRESS"], runtime_env=runtime_env)
        else:
            # The token lives as long as this process (the run); removed at exit, after RunContext's shutdown.
            local = contextlib.ExitStack()
            env_vars = local.enter_context(local_ray_env())
            atexit.register(local.close)
            # Logical CPUs: one per actor rank, engine and environment worker; CPU work is shared anyway.
            slots = cfg.trainer.devices_per_node + cfg.rollout.num_engines + cfg.env.num_workers + 2
            runtime_env["env_vars"] |= env_vars
            # No idle workers prestarted for the driver: every process of a run is an actor with the run's
            # runtime env, which those workers lack, so they were never used (measured: init 1.4 s faster).
            # address="local": a new instance even where `ray start` left one on this machine (a bare
            # ray.init() would attach to the latest such cluster, /tmp/ray/ray_current_cluster).
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, slots), include_dashboard=False,
                     runtime_env=runtime_env, logging_level=logging.WARNING,
                     _system_config={"prestart_worker_first_driver": False})
    return ray.cluster_resources()


def start_ray(cfg: Config, stack: contextlib.ExitStack, *, check_env: bool = True) -> dict[str, float]:
    """:func:`init_ray`, with ``ray.shutdown`` registered on ``stack``, then the preflight checks
    (:func:`megatron_gigpo.cluster.preflight.preflight`; ``check_env=False`` skips the environment's data and services).

    Returns ``ray.cluster_resources()``.

    Raises:
        PreflightError: the recipe cannot run here.
    """
    from megatron_gigpo.cluster.preflight import preflight
    from megatron_gigpo.run import preemption

    resources = init_ray(cfg)
    stack.callback(_shutdown_ray)
    preemption.reinstall()  # ray.init replaced the stop-signal handler of `train` / `sft` with its own
    preflight(cfg, resources if "RAY_ADDRESS" in os.environ else None, check_env=check_env)
    return resources


def actor_config(cfg: Config, model_dir: str | Path):
    """The RL actor of recipe ``cfg`` with its model at ``model_dir`` (the resolved ``model.path``): an
    :class:`~megatron_gigpo.actor.config.ActorConfig` holding the recipe's ``parallel``, ``actor`` (as the
    recompute settings), ``optim``, ``algorithm`` (as the loss), ``trainer`` and ``model.lora`` sections whole, in
    ``model.params_dtype(trainer.device)``."""
    from megatron_gigpo.actor.config import ActorConfig

    return ActorConfig(
        model_path=str(model_dir),
        params_dtype=cfg.model.params_dtype(cfg.trainer.device),
        temperature=cfg.rollout.temperature,
        lr_decay_steps=max(1, cfg.trainer.total_iterations),
        parallel=cfg.parallel, recompute=cfg.actor, optim=cfg.optim, loss=cfg.algorithm, trainer=cfg.trainer,
        lora=cfg.model.lora,
    )


def start_actor_group(cfg: Config, actor_cfg, stack: contextlib.ExitStack, *, wait: bool = True):
    """The Megatron actor ranks of ``cfg``'s layout, placed as the run's placement plan says
    (:func:`megatron_gigpo.cluster.placement.plan_placement`, the plan ``validate --plan`` prints), built from
    ``actor_cfg``; the placement groups' removal and the ranks' shutdown are registered on ``stack``. Used by RL
    training and by the SFT stage alike. ``wait=False`` returns while the ranks still start
    (:meth:`ActorGroup.wait_started <megatron_gigpo.actor.group.ActorGroup.wait_started>`).

    Returns:
        ``(plan, placement_groups, ActorGroup)``.
    """
    from megatron_gigpo.actor.group import ActorGroup
    from megatron_gigpo.cluster.placement import create_placement_groups, plan_placement, remove_placement_groups, slot_options

    plan, timeouts = plan_placement(cfg), cfg.trainer.timeouts
    groups = create_placement_groups(plan, timeout_s=timeouts.placement_s)
    stack.callback(remove_placement_groups, groups)
    actors = ActorGroup(actor_cfg, [slot_options(groups, s) for s in plan.ranks], env_vars=_rank_env(cfg),
                        start_timeout_s=timeouts.actor_start_s, call_timeout_s=timeouts.rank_call_s, wait=wait)
    stack.callback(actors.shutdown)
    return plan, groups, actors


def start_progress(stack: contextlib.ExitStack, label: str, total: int, completed: int, field: str, value: str):
    """A running rich progress bar (label, bar, done/total, the task field ``field``, elapsed time), stopped by
    ``stack``. Used by the RL run (``phase``) and the SFT stage (``status``).

    Returns:
        ``(progress, task_id)``; update the field with ``progress.update(task_id, **{field: ...})``.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn(f"{{task.fields[{field}]}}"), TimeElapsedColumn())
    task = progress.add_task(label, total=total, completed=completed, **{field: value})
    progress.start()
    stack.callback(progress.stop)
    return progress, task


class PhaseTimer:
    """Wall time per phase of one iteration, reported as ``timing/<phase>_s`` and tokens/s; shows the
    running phase on the run's progress bar (if any)."""

    def __init__(self, progress=None, task=None) -> None:
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.progress, self.task = progress, task

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        if self.progress is not None:
            self.progress.update(self.task, phase=phase)
        try:
            yield
        finally:
            self.phases[phase] = self.phases.setdefault(phase, 0.0) + time.perf_counter() - t0

    def metrics(self, num_tokens: int) -> dict[str, float]:
        total = time.perf_counter() - self.start
        out = {f"timing/{k}_s": v for k, v in self.phases.items()}
        out["timing/iteration_s"] = total
        out["perf/tokens_per_s"] = num_tokens / total if total > 0 else 0.0
        return out


def epoch_order(pool: int, seed: int, start: int, count: int) -> list[int]:
    """Positions ``start .. start + count - 1`` of an endless sequence of shuffled passes over ``pool`` tasks.

    Like a shuffling data loader (verl's train dataloader): every task once per epoch, a fresh permutation
    of ``range(pool)`` each epoch, seeded by ``(seed, epoch)``. A pure function of its arguments, so a
    resumed run sees the same tasks as an uninterrupted one.

    Returns:
        ``count`` task indices in ``[0, pool)``.
    Raises:
        ValueError: an empty pool.
    """
    if pool < 1:
        raise ValueError("the training task list is empty")
    out: list[int] = []
    epoch, pos = divmod(start, pool)
    while len(out) < count:
        order = np.random.default_rng([seed, epoch]).permutation(pool)
        take = order[pos : pos + count - len(out)]
        out.extend(int(i) for i in take)
        epoch, pos = epoch + 1, 0
    return out


class StartedStack:
    """A context manager whose ``_start()`` registers what it starts on ``self._stack`` (an ExitStack): entering
    runs ``_start()``, leaving, or a failed start, closes the stack (stops everything, newest first)."""

    _stack: contextlib.ExitStack

    def _start(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


class RunContext(StartedStack):
    """The live parts of one run. Use as a context manager; everything is stopped on exit.

    Args:
        cfg: validated config.
        load_checkpoint: a checkpoint directory or root to start from (``eval``); default: resume from
            ``checkpoint.dir`` when ``checkpoint.resume``.
        training: False for evaluation (no metric files, no checkpoints).
    """

    def __init__(self, cfg: Config, *, load_checkpoint: str | None = None, training: bool = True):
        self.cfg = cfg
        self.training = training
        self.load_from = load_checkpoint
        self.run_dir = cfg.run_dir
        self.ckpt_root = cfg.checkpoint_root
        self.start_iteration = 0
        self.saved_iteration = 0  # the newest checkpoint's iteration (0: none)
        self.task_cursor = 0  # position in the training task stream (epoch_order) of the next group
        self.weights_version = 0  # the policy version the engines were last synced to (0: the start weights)
        self.producer = None  # rollout.asynchronous: the RolloutProducer (megatron_gigpo.run.async_rollout)
        self.progress = self.bar = None
        self._stack = contextlib.ExitStack()

    # ---------------------------------------------------------------- lifetime
    def _start(self) -> None:
        from megatron_gigpo.envs.registry import load_task_list, validation_subset
        from megatron_gigpo.run.lock import hold_run_dir
        from megatron_gigpo.run.metrics import MetricsLogger
        from megatron_gigpo.models.random_init import resolve_model

        cfg = self.cfg
        if self.training:  # one run per directory, before anything starts (megatron_gigpo.run.lock)
            self._stack.enter_context(hold_run_dir(self.run_dir))
        start_ray(cfg, self._stack)
        model_dir = resolve_model(cfg.model)
        # Where every rank, engine and vLLM worker runs: the plan `validate --plan` prints (megatron_gigpo.cluster.placement).
        actor_cfg = actor_config(cfg, model_dir)
        self.plan, self.placement_groups, self.actors = start_actor_group(cfg, actor_cfg, self._stack, wait=False)
        # CPU: the engines start while the ranks build and this process loads the tokenizer (each start is mostly
        # single-threaded imports, vLLM's the longest; a two-iteration run of the tests' tiny model on 2 cores:
        # 65 s instead of 73 s one after the other). GPU: the ranks hold their memory, resumed state included,
        # before vLLM measures what is free.
        at_once = cfg.trainer.device == "cpu"
        if at_once:
            self._start_engines(model_dir, wait=False)
        from transformers import AutoTokenizer  # seconds of imports: while the ranks and engines start

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.train_task_list = load_task_list(cfg.env, "train")
        self.val_task_list = validation_subset(load_task_list(cfg.env, "val"), cfg.env.val_num_groups)
        self.actors.wait_started()
        self._resume()
        if not at_once:
            self._start_engines(model_dir)
        self.engines.wait_started()
        self.collector = _build_collector(cfg, self.tokenizer, self.engines)
        self._stack.callback(self.collector.close)
        if self.start_iteration > 0:
            self.sync_weights(version=self.start_iteration)
        if self.training:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
            self.logger = MetricsLogger(cfg, self.run_dir, resume_step=self.start_iteration)
            self._stack.callback(self.logger.close)
            if cfg.logging.progress_bars:
                self._start_progress()
            if cfg.trainer.val_before_train and self.start_iteration == 0 and cfg.trainer.val_every > 0:
                self.log(self.validate(0), 0)
            if cfg.rollout.asynchronous.enabled:
                self._start_producer()

    def _start_engines(self, model_dir: Path, *, wait: bool = True) -> None:
        self.engines = _build_engines(self.cfg, model_dir, self.plan, self.placement_groups, wait=wait)
        self._stack.callback(self.engines.shutdown)

    def _start_producer(self) -> None:
        """The asynchronous rollout's producer thread (:mod:`megatron_gigpo.run.async_rollout`), from the resumed
        iteration and consumed task cursor; stopped before the collector closes."""
        from megatron_gigpo.run.async_rollout import RolloutProducer
        from megatron_gigpo.run.preemption import requested

        cfg, k = self.cfg, self.cfg.rollout.asynchronous.max_staleness
        t, ds = cfg.trainer.timeouts, cfg.algorithm.dynamic_sampling
        round_s = (cfg.env.max_steps + 1) * (t.generate_s + t.env_call_s + cfg.env.step_latency_s)
        self.producer = RolloutProducer(
            self._collect_item, start_iteration=self.start_iteration, task_cursor=self.task_cursor, max_staleness=k,
            end_iteration=cfg.trainer.total_iterations, round_timeout_s=round_s,
            item_timeout_s=round_s * (ds.max_rounds if ds.enabled else 1), stop=requested)
        self._stack.callback(self.producer.stop)
        if self.start_iteration > 0:
            first, last = self.start_iteration + 1, min(self.start_iteration + k + 1, cfg.trainer.total_iterations)
            log.warning("asynchronous rollout: the batches of iteration(s) %s that the earlier attempt may have "
                        "collected are collected again from task cursor %d by policy version %d",
                        first if first == last else f"{first}..{last}", self.task_cursor, self.start_iteration)

    def _start_progress(self) -> None:
        self.progress, self.bar = start_progress(self._stack, "GiGPO", self.cfg.trainer.total_iterations,
                                                 self.start_iteration, "phase", "starting")

    def _resume(self) -> None:
        root = self.load_from if self.load_from else (str(self.ckpt_root) if self.cfg.checkpoint.resume else None)
        if root is None:
            return
        state = self.actors.load_checkpoint(root)
        if state is None:
            if self.load_from:
                raise FileNotFoundError(f"--checkpoint {self.load_from}: no complete checkpoint there")
            return
        self.start_iteration = self.saved_iteration = int(state["iteration"])
        # Checkpoints written before dynamic sampling have no cursor: one round of num_groups per iteration.
        self.task_cursor = int(state.get("task_cursor", self.start_iteration * self.cfg.env.num_groups))
        log.info("resumed from %s at iteration %d", root, self.start_iteration)

    # ---------------------------------------------------------------- per iteration
    def timer(self) -> PhaseTimer:
        return PhaseTimer(self.progress, self.bar)

    def next_train_tasks(self) -> list:
        """The next ``env.num_groups`` tasks of the run's seeded task stream (:meth:`train_tasks` at
        ``task_cursor``, which advances past them). Without dynamic sampling iteration ``i`` gets positions
        ``i * num_groups ...``; each extra generation round takes the next ones. The cursor is saved in every
        checkpoint, so a resumed run draws the same tasks as an uninterrupted one."""
        tasks = self.train_tasks(self.task_cursor)
        self.task_cursor += len(tasks)
        return tasks

    def train_tasks(self, cursor: int) -> list:
        """``env.num_groups`` tasks of the seeded task stream from position ``cursor`` (:func:`epoch_order`)."""
        idx = epoch_order(len(self.train_task_list), self.cfg.trainer.seed, cursor, self.cfg.env.num_groups)
        return [self.train_task_list[i] for i in idx]

    def collect_train_batch(self, iteration: int) -> tuple[Any, dict[str, float]] | None:
        """The training batch of 0-based ``iteration`` and its rollout metrics: one collection, or with
        ``algorithm.dynamic_sampling.enabled`` the informative groups of up to ``max_rounds`` generation rounds
        (:func:`megatron_gigpo.episodes.dynamic_sampling.collect_informative`).

        None when a stop signal (:mod:`megatron_gigpo.run.preemption`) came during the rollout: its episodes are
        abandoned at their next step and the task cursor goes back, so a resumed run draws the same tasks.

        Asynchronous rollout: the producer's item of ``iteration`` (:meth:`RolloutProducer.take
        <megatron_gigpo.run.async_rollout.RolloutProducer.take>`), its groups checked
        (:func:`~megatron_gigpo.run.async_rollout.check_groups`); the consumed cursor becomes ``task_cursor``."""
        from megatron_gigpo.episodes.collector import RolloutStopped
        from megatron_gigpo.run.preemption import requested

        if self.producer is not None:
            return self._take_item(iteration)
        cursor = self.task_cursor

        def one_round(k: int = 0):
            return self.collector.collect(self.next_train_tasks(), iteration, round_index=k, stop=requested)

        try:
            collected = self._rounds(one_round, iteration)
        except RolloutStopped:  # stopped between two steps; otherwise the signal came during the last one
            collected = None
        if requested() is None:
            return collected
        self.task_cursor = cursor
        log.warning("%s during the rollout of iteration %d: its episodes are abandoned (the resumed run collects "
                    "them again)", requested(), iteration + 1)
        return None

    def _rounds(self, one_round, iteration: int):
        """One round, or with dynamic sampling those :func:`~megatron_gigpo.episodes.dynamic_sampling.
        collect_informative` runs: ``(batch, metrics)`` of 0-based ``iteration``."""
        ds = self.cfg.algorithm.dynamic_sampling
        if not ds.enabled:
            return one_round()
        from megatron_gigpo.episodes.dynamic_sampling import collect_informative

        return collect_informative(one_round, num_groups=self.cfg.env.num_groups, criterion=ds.criterion,
                                   max_rounds=ds.max_rounds, estimator=self.cfg.algorithm.adv_estimator,
                                   params=self.cfg.algorithm, iteration=iteration + 1)

    def _collect_item(self, iteration: int, cursor: int, producer) -> tuple[Any, dict[str, float], int]:
        """The producer thread's item of ``iteration`` from task position ``cursor``: each round inside the gate."""
        def one_round(k: int = 0):
            nonlocal cursor
            with producer.gate():
                tasks, cursor = self.train_tasks(cursor), cursor + self.cfg.env.num_groups
                return self.collector.collect(tasks, iteration, round_index=k, stop=producer.stopped)

        batch, metrics = self._rounds(one_round, iteration)
        return batch, metrics, cursor

    def _take_item(self, iteration: int) -> tuple[Any, dict[str, float]] | None:
        from megatron_gigpo.run.async_rollout import check_groups
        from megatron_gigpo.run.preemption import requested

        item = self.producer.take(iteration)
        if item is None:
            log.warning("%s before the batch of iteration %d was collected (the resumed run collects it again)",
                        requested(), iteration + 1)
            return None
        self.task_cursor = item.cursor_after  # the consumed cursor: what a checkpoint saves
        metrics = check_groups(item.batch, iteration, self.cfg.rollout.asynchronous.max_staleness)
        return item.batch, item.metrics | metrics | {"async/task_cursor": float(item.cursor_after)}

    @contextlib.contextmanager
    def engines_paused(self) -> Iterator[None]:
        """Asynchronous rollout: the producer's :meth:`~megatron_gigpo.run.async_rollout.RolloutProducer.pause`
        (the round in flight ends first, none starts inside), then the engines' version published; a null
        context otherwise."""
        if self.producer is None:
            yield
            return
        with self.producer.pause():
            yield
            self.producer.publish(self.weights_version)

    def probe_engines(self, batch) -> dict[str, float]:
        """:func:`megatron_gigpo.run.batch_checks.engine_probe` of ``batch`` on the engines' new version."""
        from megatron_gigpo.run.batch_checks import engine_probe

        return engine_probe(self.cfg, self.actors, self.engines, self.collector.sampling, batch, self.weights_version)

    def sync_weights(self, version: int) -> dict[str, float]:
        from megatron_gigpo.rollout.weight_sync import sync_weights

        # The backend is the engines' (started with the plan's weight_backend); every engine node has an actor rank.
        metrics = sync_weights(self.actors, self.engines, version=version,
                               bucket_size_bytes=self.cfg.rollout.bucket_size_mb << 20,
                               timeout_s=self.cfg.trainer.timeouts.weight_sync_s)
        # A float fingerprint of what the engines now serve (the full checksum is checked inside the sync).
        _, checksum = self.engines.weights_version()[0]
        metrics["weight_sync/checksum_fp"] = float(int(checksum[:8], 16))
        self.weights_version = version
        return metrics

    def engine_check(self, batch, actor_log_probs=None) -> dict[str, float]:
        """:func:`megatron_gigpo.run.batch_checks.engine_check` against the engines' last synced version."""
        from megatron_gigpo.run.batch_checks import engine_check

        return engine_check(self.cfg, self.actors, batch, self.weights_version, actor_log_probs,
                            lagged=self.producer is not None)

    def _due(self, iteration: int, every: int) -> bool:
        """Every ``every`` iterations (0: never), and at the last iteration."""
        return every > 0 and (iteration % every == 0 or iteration == self.cfg.trainer.total_iterations)

    def should_validate(self, iteration: int) -> bool:
        return self._due(iteration, self.cfg.trainer.val_every)

    def validate(self, iteration: int) -> dict[str, float]:
        """Greedy, one rollout per validation task; metrics prefixed ``val/``. In training, each episode's outcome
        also goes to ``<run dir>/validation/step_<iteration>.jsonl`` (:func:`~megatron_gigpo.run.metrics.
        write_validation_episodes`)."""
        from megatron_gigpo.rollout.engine import SamplingConfig

        r = self.cfg.rollout
        greedy = SamplingConfig(temperature=r.val_temperature, top_p=1.0, top_k=-1, max_tokens=r.response_length,
                                stop=list(r.stop), seed=self.cfg.trainer.seed)
        batch, metrics = self.collector.collect(self.val_task_list, iteration, validation=True, group_size=1,
                                                sampling=greedy)
        if self.training:  # per-task outcomes beside metrics.jsonl; `eval` writes nothing into a run folder
            from megatron_gigpo.run.metrics import write_validation_episodes

            write_validation_episodes(self.run_dir, iteration, batch.extras["episodes"])
        return {f"val/{k}": v for k, v in metrics.items()}

    def should_save(self, iteration: int) -> bool:
        return self._due(iteration, self.cfg.checkpoint.save_every)

    def save_checkpoint(self, iteration: int) -> None:
        state = {"iteration": iteration, "task_cursor": self.task_cursor}  # the consumed cursor (async too)
        if self.producer is not None:
            state["async"] = {"max_staleness": self.cfg.rollout.asynchronous.max_staleness}
        self.actors.save_checkpoint(str(self.ckpt_root), iteration, state,
                                    keep_last=self.cfg.checkpoint.keep_last)
        self.saved_iteration = iteration

    def stop_checkpoint(self, done: int) -> Path | None:
        """After a stop signal: the checkpoint of the ``done`` completed iterations, written unless it exists
        (whatever ``checkpoint.save_every`` says); None when no iteration was completed."""
        from megatron_gigpo.actor.checkpoint_layout import checkpoint_name
        from megatron_gigpo.run.preemption import requested

        if done == 0:
            return None
        if self.saved_iteration != done:
            start = time.perf_counter()
            self.save_checkpoint(done)
            log.warning("checkpoint of iteration %d written in %.1f s after %s", done, time.perf_counter() - start,
                        requested())
        return self.ckpt_root / checkpoint_name(done)

    @staticmethod
    def advantage_metrics(adv) -> dict[str, float]:
        a = adv.advantage.double()
        return {"advantage/mean": float(a.mean()), "advantage/std": float(a.std()) if a.numel() > 1 else 0.0,
                "advantage/max": float(a.max()), "advantage/min": float(a.min())}

    @staticmethod
    def rollout_actor_gap(batch, actor_log_probs) -> dict[str, float]:
        """:func:`megatron_gigpo.run.batch_checks.rollout_actor_gap`."""
        from megatron_gigpo.run.batch_checks import rollout_actor_gap

        return rollout_actor_gap(batch, actor_log_probs)

    def update_effect(self, batch, row_advantages, old_log_probs) -> dict[str, float]:
        """:func:`megatron_gigpo.run.batch_checks.update_effect` with the run's actor ranks."""
        from megatron_gigpo.run.batch_checks import update_effect

        return update_effect(self.actors, batch, row_advantages, old_log_probs)

    @staticmethod
    def num_tokens(batch) -> int:
        return int(sum(p.numel() + r.numel() for p, r in zip(batch.prompt_ids, batch.response_ids)))

    def log(self, metrics: dict[str, Any], iteration: int) -> None:
        from megatron_gigpo.run.metrics import console_line

        if self.producer is not None:
            metrics = metrics | self.producer.wait_metrics()
        self.logger.log(metrics, iteration)
        line = console_line(metrics, iteration, self.cfg.trainer.total_iterations, self.cfg.env.name)
        if self.progress is None:
            print(line, flush=True)
        else:
            self.progress.update(self.bar, completed=iteration, phase="")
            self.progress.console.print(line, soft_wrap=True)


def _rank_env(cfg: Config) -> dict[str, str]:
    from megatron_gigpo.cluster.ray_setup import worker_env

    env = worker_env()
    if cfg.trainer.device == "cpu":
        # Ranks share the machine's cores with the engines and environments; avoid oversubscription.
        threads = max(1, (os.cpu_count() or 1) // cfg.trainer.devices_per_node)
        env |= {"OMP_NUM_THREADS": str(threads)}
    return env


def _shutdown_ray() -> None:
    import ray

    ray.shutdown()


def _build_engines(cfg: Config, model_dir: Path, plan, groups, *, wait: bool = True):
    """The vLLM engines, each started where ``plan`` puts it (:func:`megatron_gigpo.cluster.placement.engine_options`);
    ``wait=False`` returns while they start (:meth:`RolloutEngineGroup.wait_started
    <megatron_gigpo.rollout.engine_group.RolloutEngineGroup.wait_started>`)."""
    from megatron_gigpo.cluster.placement import engine_options
    from megatron_gigpo.rollout.engine_group import RolloutEngineGroup

    return RolloutEngineGroup(
        str(model_dir), cfg.rollout, dtype=cfg.model.params_dtype(cfg.trainer.device),
        ray_options=[engine_options(groups, e) for e in plan.engines], timeouts=cfg.trainer.timeouts,
        distributed_executor_backend=plan.engines[0].executor, seed=cfg.trainer.seed,
        num_cpus=plan.engines[0].host.num_cpus, weight_transfer_backend=plan.weight_backend, wait=wait,
        return_routed_experts=cfg.algorithm.router_replay == "rollout",
        # log-probs of logits / temperature (after top-k / top-p when on): what the actor computes without them
        logprobs_mode="processed_logprobs",
    )


def _build_collector(cfg: Config, tokenizer, engines):
    from megatron_gigpo.envs.registry import env_kwargs
    from megatron_gigpo.episodes.collector import EpisodeCollector
    from megatron_gigpo.rollout.engine import SamplingConfig

    r, e = cfg.rollout, cfg.env
    sampling = SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.response_length,
                              stop=list(r.stop), seed=cfg.trainer.seed)
    return EpisodeCollector(
        e.name, env_kwargs(e), tokenizer, engines, group_size=r.n, num_groups=e.num_groups,
        max_steps=e.max_steps, sampling=sampling, num_workers=e.num_workers, seed=e.seed, num_cpus_per_worker=0.01,
        prompt_overflow=r.prompt_overflow, **step_prompt_settings(cfg), env_call_timeout_s=cfg.trainer.timeouts.env_call_s,
        env_step_latency_s=e.step_latency_s,
    )


def step_prompt_settings(cfg: Config) -> dict[str, Any]:
    """The recipe's per-step prompt settings: keyword arguments of
    :func:`~megatron_gigpo.episodes.prompts.step_prompt_renderer` (and of the collector). One mapping for the
    RL collector and the demonstration writer, so both render identical prompts."""
    return {"history_length": cfg.env.history_length, "max_prompt_length": cfg.rollout.prompt_length,
            "prompt_style": cfg.env.prompt_template}
