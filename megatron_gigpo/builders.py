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

log = logging.getLogger(__name__)

# Logical CPU share of one CPU-device actor rank: ranks, engines and environment workers time-share the cores,
# and a Slurm job advertises only its allocated CPUs to Ray.
CPU_RANK_SHARE = 0.25
CPU_ENGINE_SHARE = 0.5
# Colocated GPU mode: an actor rank and a vLLM engine share one GPU bundle.
GPU_RANK_SHARE = 0.5
GPU_ENGINE_SHARE = 0.4


def actor_config(cfg: Config, model_dir: Path):
    """Map the recipe onto the per-rank :class:`~megatron_gigpo.actor.config.ActorConfig`."""
    from megatron_gigpo.actor.config import ActorConfig, LossSettings, OptimizerSettings

    o, a, t = cfg.optim, cfg.algorithm, cfg.trainer
    return ActorConfig(
        model_path=str(model_dir),
        params_dtype="float32" if t.device == "cpu" else cfg.model.dtype,
        tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        optim=OptimizerSettings(
            lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
            lr_warmup_steps=o.lr_warmup_steps, lr_decay_steps=max(1, t.total_iterations),
            lr_decay_style=o.lr_decay_style,
        ),
        loss=LossSettings(
            clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
            loss_agg_mode=a.loss_agg_mode, use_kl_loss=a.use_kl_loss, kl_loss_type=a.kl_loss_type,
            kl_loss_coef=a.kl_loss_coef, entropy_coeff=a.entropy_coeff,
        ),
        ppo_mini_batch_size=t.ppo_mini_batch_size,
        ppo_epochs=t.ppo_epochs,
        micro_batch_tokens=t.micro_batch_tokens,
        log_prob_micro_batch_tokens=t.log_prob_micro_batch_tokens,
        temperature=cfg.rollout.temperature,
        seed=t.seed,
    )


def init_ray(cfg: Config) -> dict[str, float]:
    """Connect to ``RAY_ADDRESS`` (a cluster, e.g. from slurm/train.sbatch) or start a local Ray.

    Token authentication either way (:mod:`megatron_gigpo.ray_setup`): a local Ray gets a fresh token file
    that is removed when this process exits; a cluster needs the token that the environment provides.

    Returns ``ray.cluster_resources()``.
    Raises:
        RayAuthError: no token, a refused token, or a bad ``MEGATRON_GIGPO_RAY_AUTH``.
    """
    import atexit

    import ray

    from megatron_gigpo.ray_setup import connect_ray, local_ray_env

    if not ray.is_initialized():
        if "RAY_ADDRESS" in os.environ:
            connect_ray(os.environ["RAY_ADDRESS"])
        else:
            # The token lives as long as this process (the run); removed at exit, after RunContext's shutdown.
            local = contextlib.ExitStack()
            env_vars = local.enter_context(local_ray_env())
            atexit.register(local.close)
            # Logical CPUs: one per actor rank, engine and environment worker; CPU work is shared anyway.
            slots = cfg.trainer.devices_per_node + cfg.rollout.num_engines + cfg.env.num_workers + 2
            ray.init(num_cpus=max(os.cpu_count() or 1, slots), include_dashboard=False,
                     runtime_env={"env_vars": env_vars}, logging_level=logging.WARNING)
    return ray.cluster_resources()


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


class RunContext:
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
        self.progress = self.bar = None
        self._stack = contextlib.ExitStack()

    # ---------------------------------------------------------------- lifetime
    def __enter__(self) -> "RunContext":
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _start(self) -> None:
        from transformers import AutoTokenizer

        from megatron_gigpo.actor_group import ActorGroup
        from megatron_gigpo.algo.advantages import AdvantageParams
        from megatron_gigpo.env_settings import load_task_list, validation_subset
        from megatron_gigpo.metrics import MetricsLogger
        from megatron_gigpo.models.builtin import resolve_model_path
        from megatron_gigpo.preflight import preflight

        cfg = self.cfg
        resources = init_ray(cfg)
        preflight(cfg, resources if "RAY_ADDRESS" in os.environ else None)
        self._stack.callback(_shutdown_ray)
        model_dir = resolve_model_path(cfg.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.adv_params = AdvantageParams.from_algorithm_config(cfg.algorithm)
        self.train_task_list = load_task_list(cfg.env, "train")
        self.val_task_list = validation_subset(load_task_list(cfg.env, "val"), cfg.env.val_num_groups)

        world = cfg.trainer.nnodes * cfg.trainer.devices_per_node
        use_gpu = cfg.trainer.device == "cuda"
        self.placement = _placement_group(world, use_gpu)
        self.actors = ActorGroup(actor_config(cfg, model_dir), world, self.placement,
                                 num_gpus=(GPU_RANK_SHARE if _gpu_colocated(cfg) else 1) if use_gpu else 0,
                                 num_cpus=1 if use_gpu else CPU_RANK_SHARE, env_vars=_rank_env(cfg))
        self._stack.callback(self.actors.shutdown)
        self._resume()
        self.engines = _build_engines(cfg, model_dir, self.placement)
        self._stack.callback(self.engines.shutdown)
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

    def _start_progress(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]GiGPO"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[phase]}"), TimeElapsedColumn())
        self.bar = self.progress.add_task("train", total=self.cfg.trainer.total_iterations,
                                          completed=self.start_iteration, phase="starting")
        self.progress.start()
        self._stack.callback(self.progress.stop)

    def _resume(self) -> None:
        root = self.load_from if self.load_from else (str(self.ckpt_root) if self.cfg.checkpoint.resume else None)
        if root is None:
            return
        state = self.actors.load_checkpoint(root)
        if state is None:
            if self.load_from:
                raise FileNotFoundError(f"--checkpoint {self.load_from}: no complete checkpoint there")
            return
        self.start_iteration = int(state["iteration"])
        log.info("resumed from %s at iteration %d", root, self.start_iteration)

    # ---------------------------------------------------------------- per iteration
    def timer(self) -> PhaseTimer:
        return PhaseTimer(self.progress, self.bar)

    def train_tasks(self, iteration: int) -> list:
        """The ``env.num_groups`` tasks of ``iteration`` (:func:`epoch_order`)."""
        n = self.cfg.env.num_groups
        idx = epoch_order(len(self.train_task_list), self.cfg.trainer.seed, iteration * n, n)
        return [self.train_task_list[i] for i in idx]

    def sync_weights(self, version: int) -> dict[str, float]:
        from megatron_gigpo.rollout.weight_sync import sync_weights

        metrics = sync_weights(self.actors, self.engines, version=version,
                               bucket_size_bytes=self.cfg.rollout.bucket_size_mb << 20,
                               mode=self.cfg.rollout.weight_sync_mode)
        # A float fingerprint of what the engines now serve (the full checksum is checked inside the sync).
        _, checksum = self.engines.weights_version()[0]
        metrics["weight_sync/checksum_fp"] = float(int(checksum[:8], 16))
        return metrics

    def _due(self, iteration: int, every: int) -> bool:
        """Every ``every`` iterations (0: never), and at the last iteration."""
        return every > 0 and (iteration % every == 0 or iteration == self.cfg.trainer.total_iterations)

    def should_validate(self, iteration: int) -> bool:
        return self._due(iteration, self.cfg.trainer.val_every)

    def validate(self, iteration: int) -> dict[str, float]:
        """Greedy, one rollout per validation task; metrics prefixed ``val/``."""
        from megatron_gigpo.rollout.engine import SamplingConfig

        r = self.cfg.rollout
        greedy = SamplingConfig(temperature=r.val_temperature, top_p=1.0, top_k=-1, max_tokens=r.response_length,
                                stop=list(r.stop), seed=self.cfg.trainer.seed)
        _, metrics = self.collector.collect(self.val_task_list, iteration, validation=True, group_size=1,
                                            sampling=greedy)
        return {f"val/{k}": v for k, v in metrics.items()}

    def should_save(self, iteration: int) -> bool:
        return self._due(iteration, self.cfg.checkpoint.save_every)

    def save_checkpoint(self, iteration: int) -> None:
        self.actors.save_checkpoint(str(self.ckpt_root), iteration, {"iteration": iteration},
                                    keep_last=self.cfg.checkpoint.keep_last)

    @staticmethod
    def advantage_metrics(adv) -> dict[str, float]:
        a = adv.advantage.double()
        return {"advantage/mean": float(a.mean()), "advantage/std": float(a.std()) if a.numel() > 1 else 0.0,
                "advantage/max": float(a.max()), "advantage/min": float(a.min())}

    @staticmethod
    def rollout_actor_gap(batch, actor_log_probs) -> dict[str, float]:
        """How far vLLM's sampling log-probs are from the actor's on the same tokens and weights.

        A sync that failed to reach the engines shows up here at once (the engines would sample from
        stale weights); otherwise the gap is numerical noise (fp32 ~1e-4, bf16 ~1e-2).
        """
        import torch

        diffs = [(r.float() - a.float()).abs() for r, a in zip(batch.rollout_log_probs, actor_log_probs) if r.numel()]
        if not diffs:
            return {}
        d = torch.cat(diffs)
        return {"rollout/actor_logprob_diff_max": float(d.max()), "rollout/actor_logprob_diff_mean": float(d.mean())}

    @staticmethod
    def num_tokens(batch) -> int:
        return int(sum(p.numel() + r.numel() for p, r in zip(batch.prompt_ids, batch.response_ids)))

    def log(self, metrics: dict[str, Any], iteration: int) -> None:
        self.logger.log(metrics, iteration)
        env = self.cfg.env.name
        keys = [k for k in (f"episode/{env}/success_rate", f"val/episode/{env}/success_rate", "actor/pg_loss",
                            "timing/iteration_s") if k in metrics]
        line = f"iteration {iteration}: " + ", ".join(f"{k}={metrics[k]:.4g}" for k in keys)
        if self.progress is None:
            print(line, flush=True)
        else:
            self.progress.update(self.bar, completed=iteration, phase="")
            self.progress.console.print(line, soft_wrap=True)


def _gpu_colocated(cfg: Config) -> bool:
    """Engines share the actor ranks' GPUs: colocated mode with single-GPU (TP 1) engines."""
    return cfg.rollout.weight_sync_mode == "colocated" and cfg.rollout.tensor_parallel_size == 1


def _placement_group(world: int, use_gpu: bool):
    import ray
    from ray.util.placement_group import placement_group

    bundle = {"GPU": 1, "CPU": 2} if use_gpu else {"CPU": CPU_RANK_SHARE}
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
    ray.get(pg.ready(), timeout=600)
    return pg


def _rank_env(cfg: Config) -> dict[str, str]:
    from megatron_gigpo.ray_setup import worker_env

    env = worker_env()
    if cfg.trainer.device == "cpu":
        # Ranks share the machine's cores with the engines and environments; avoid oversubscription.
        threads = max(1, (os.cpu_count() or 1) // cfg.trainer.devices_per_node)
        env |= {"OMP_NUM_THREADS": str(threads)}
    return env


def _shutdown_ray() -> None:
    import ray

    ray.shutdown()


def _build_engines(cfg: Config, model_dir: Path, placement):
    """The vLLM engines. Colocated on GPU (engine TP 1): engine k shares actor bundle k's GPU (the actor
    rank takes half of it, the engine 0.4); otherwise engines get their own devices."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from megatron_gigpo.rollout.engine import RolloutEngineGroup

    r, use_gpu = cfg.rollout, cfg.trainer.device == "cuda"
    ray_options: dict[str, Any] = {}
    if use_gpu and _gpu_colocated(cfg):
        ray_options = {"num_gpus": GPU_ENGINE_SHARE, "scheduling_strategy": PlacementGroupSchedulingStrategy(placement)}
    engines = RolloutEngineGroup(
        str(model_dir), r.num_engines, ray_options=ray_options, tensor_parallel_size=r.tensor_parallel_size,
        dtype="float32" if not use_gpu else cfg.model.dtype, max_model_len=r.prompt_length + r.response_length,
        seed=cfg.trainer.seed, gpu_memory_utilization=r.gpu_memory_utilization,
        cpu_kvcache_space_gib=float(r.cpu_kvcache_space_gib), enforce_eager=r.enforce_eager,
        num_cpus=1.0 if use_gpu else CPU_ENGINE_SHARE,
    )
    return engines


def _build_collector(cfg: Config, tokenizer, engines):
    from megatron_gigpo.env_settings import env_kwargs
    from megatron_gigpo.episodes.collector import EpisodeCollector
    from megatron_gigpo.rollout.engine import SamplingConfig

    r, e = cfg.rollout, cfg.env
    sampling = SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.response_length,
                              stop=list(r.stop), seed=cfg.trainer.seed)
    return EpisodeCollector(
        e.name, env_kwargs(e), tokenizer, engines, group_size=r.n, num_groups=e.num_groups,
        max_steps=e.max_steps, history_length=e.history_length, max_prompt_length=r.prompt_length,
        sampling=sampling, num_workers=e.num_workers, seed=e.seed, num_cpus_per_worker=0.01,
        prompt_overflow=r.prompt_overflow,
    )
