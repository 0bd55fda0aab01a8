"""The Megatron policy actor: one instance per rank (hosted in a Ray actor by the driver, or in a spawned test
process). Every rank is called with the *same* arguments; the actor splits rows over data-parallel ranks
itself and every rank returns the same results.

Building blocks: :mod:`.batching` (token-budget micro-batches), :mod:`.logprob` (vocab-parallel, chunked
log-probs through Megatron's pipeline schedules), :mod:`.update` (one optimizer step per mini-batch),
:mod:`.checkpoint` (``dist_checkpointing``). Models come from :mod:`megatron_gigpo.models` (HF <-> Megatron).
"""

from __future__ import annotations

import dataclasses

from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_gigpo.actor import distributed, lora
from megatron_gigpo.actor.batching import (
    build_micro_batch,
    plan_micro_batches,
    split_mini_batches,
    split_rows_balanced,
    update_is_on_policy,
)
from megatron_gigpo.actor.checkpoint import CheckpointState, load_actor_checkpoint, save_actor_checkpoint
from megatron_gigpo.actor.config import ActorConfig
from megatron_gigpo.actor.logprob import HeadSettings, run_forward_only
from megatron_gigpo.actor.router_replay import ROUTED_EXPERTS, ReplayedRouters
from megatron_gigpo.algo.config import router_replay_errors
from megatron_gigpo.actor.update import MiniBatchPlan, RowData, train_mini_batch
from megatron_gigpo.models.builder import build_gpt_model, load_hf_config, moe_settings
from megatron_gigpo.models.checkpoint import write_model_sidecar
from megatron_gigpo.models.weights import export_hf_weights, export_metadata, load_hf_weights

__all__ = ["PolicyActor"]


def _lengths(prompt_ids: Sequence[torch.Tensor], response_ids: Sequence[torch.Tensor]) -> list[int]:
    return [int(p.numel()) + int(r.numel()) for p, r in zip(prompt_ids, response_ids)]


class PolicyActor:
    """Policy (and optional frozen reference) model on this rank, with Megatron DDP, optimizer and schedule.

    Construction initialises torch.distributed / Megatron parallel state if needed
    (:func:`megatron_gigpo.actor.distributed.initialize`), builds this pipeline stage of the policy from
    ``config.model_path`` and, when ``config.loss.use_kl_loss``, a frozen reference copy. With
    ``config.lora.enabled`` the base is frozen, LoRA adapters train (:mod:`.lora`) and the reference is the
    same model with its adapters disabled (no copy).

    Raises:
        ValueError: invalid config (see :meth:`ActorConfig.validate`), ``sequence_packing`` with a model
            whose attention cannot take packed sequences, or ``loss.router_replay`` that the model or layout cannot
            run (:func:`megatron_gigpo.algo.config.router_replay_errors`: a dense model, ...).
    """

    def __init__(self, config: ActorConfig) -> None:
        config.validate()
        p = config.parallel
        self.hf_config = load_hf_config(config.model_path)
        errors = router_replay_errors(config.loss.router_replay, num_experts=getattr(self.hf_config, "num_experts", None),
                                      model=str(config.model_path), pipeline_stages=p.pipeline_model_parallel_size,
                                      recompute_granularity=config.recompute.recompute_granularity)
        if errors:  # before any process group or model exists
            raise ValueError("; ".join(errors))
        distributed.initialize(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, seed=config.trainer.seed,
                               expert_model_parallel_size=p.expert_model_parallel_size,
                               expert_tensor_parallel_size=p.expert_tensor_parallel_size)
        config.validate(dist.get_world_size())
        self.config = config
        self.device = distributed.device()
        policy = self._build_model()
        self.lora_layers: list[str] = []
        if config.lora.enabled:
            self.lora_layers = lora.apply_lora(policy, config.lora, seed=config.trainer.seed)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=config.parallel.use_distributed_optimizer,
        )
        self.model_chunks = [DistributedDataParallel(config=policy.config, ddp_config=ddp_config, module=policy)]
        self.optimizer = get_megatron_optimizer(self._optimizer_config(), self.model_chunks)
        self.scheduler = self._scheduler()
        # Megatron's schedules read these hooks from the model config (as Megatron-LM's training loop sets).
        policy.config.no_sync_func = self.model_chunks[0].no_sync
        policy.config.finalize_model_grads_func = finalize_model_grads
        policy.config.grad_scale_func = self.optimizer.scale_loss
        self.reference_chunks = None
        if config.loss.use_kl_loss and not config.lora.enabled:
            reference = self._build_model()
            reference.requires_grad_(False)
            self.reference_chunks = [reference]
        self.replay = self.reference_replay = None  # routing replay (algorithm.router_replay=rollout)
        if config.loss.router_replay == "rollout":
            layers = int(self.hf_config.num_hidden_layers)
            self.replay = ReplayedRouters(self.model_chunks, layers)
            if self.reference_chunks is not None:
                self.reference_replay = ReplayedRouters(self.reference_chunks, layers)
        #: after each compute_log_probs of the policy with routing replay: actor/router_replay_mismatch metrics
        self.router_metrics: dict[str, float] = {}
        self.update_calls = 0
        self.optimizer_steps = 0

    # ------------------------------------------------------------------ construction
    def _build_model(self) -> torch.nn.Module:
        overrides = self.config.transformer_overrides()  # sequence parallelism, activation recomputation
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            # micro-batches differ in (rows, length): stages exchange tensor shapes before activations.
            # TransformerConfig rejects this with its default MoE dispatcher (allgather) even for dense
            # models, so name the one that supports it.
            overrides["variable_seq_lengths"] = True
            overrides["moe_token_dispatcher_type"] = "alltoall"
        if moe_settings(self.hf_config, parallel_state.get_expert_model_parallel_world_size()):
            overrides["moe_aux_loss_coeff"] = self.config.loss.moe_aux_loss_coeff
            overrides["moe_enable_routing_replay"] = self.config.loss.router_replay == "rollout"
        model = build_gpt_model(self.hf_config, params_dtype=self.config.torch_dtype, **overrides)
        load_hf_weights(model, self.config.model_path)
        if self.config.trainer.sequence_packing:
            from megatron.core.transformer.dot_product_attention import DotProductAttention

            if any(isinstance(m, DotProductAttention) for m in model.modules()):
                raise ValueError(
                    "trainer.sequence_packing=True needs Transformer-Engine attention; this model uses "
                    "Megatron's local DotProductAttention, which rejects PackedSeqParams (use padding)"
                )
        return model

    def _optimizer_config(self) -> OptimizerConfig:
        c, o = self.config, self.config.optim
        bf16 = c.torch_dtype == torch.bfloat16
        return OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=bf16,
            params_dtype=c.torch_dtype,
            use_distributed_optimizer=c.parallel.use_distributed_optimizer,
        )

    def _scheduler(self) -> OptimizerParamScheduler:
        o = self.config.optim
        return OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps,
            # Megatron requires decay steps > warmup steps even for a constant schedule
            lr_decay_steps=max(self.config.lr_decay_steps, o.lr_warmup_steps + 1),
            lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=max(self.config.lr_decay_steps, 1),
            wd_incr_style="constant",
        )

    # ------------------------------------------------------------------ log-probs
    def compute_log_probs(self, batch, *, reference: bool = False) -> list[torch.Tensor]:
        """Per-token log-probs of every row's response under the policy (or the frozen reference).

        Args:
            batch: a :class:`~megatron_gigpo.episodes.batch.TrainingBatch` (only ``prompt_ids`` and
                ``response_ids`` are read); the same on every rank.
            reference: use the reference model (requires ``loss.use_kl_loss``).

        Returns:
            per row, float32 (R_i,) on the CPU, identical on every rank.

        A data-parallel rank left without rows (fewer rows than ranks) runs no forward pass and receives the
        others' results.

        Raises:
            ValueError: ``reference=True`` without a reference model.
        """
        log_probs, _ = self._forward(batch, reference=reference, with_entropy=False)
        return log_probs

    def compute_log_probs_and_entropy(
        self, batch, *, reference: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """As :meth:`compute_log_probs`, plus per-token entropy (nats) of the full next-token distribution."""
        log_probs, entropy = self._forward(batch, reference=reference, with_entropy=True)
        return log_probs, entropy

    def _head(self, *, with_entropy: bool, entropy_grad: bool) -> HeadSettings:
        return HeadSettings(
            chunk_size=self.config.trainer.logprob_chunk_size,
            temperature=self.config.temperature,
            vocab_size=int(self.hf_config.vocab_size),
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )

    def _dp_shares(self, lengths: Sequence[int], rows: Sequence[int]) -> list[list[int]]:
        """``rows`` split over data-parallel ranks by token count (same answer on every rank)."""
        shares = split_rows_balanced([lengths[r] for r in rows], parallel_state.get_data_parallel_world_size())
        return [[rows[i] for i in share] for share in shares]

    def _dp_plans(self, lengths: Sequence[int], rows: Sequence[int], budget: int) -> list[list[list[int]]]:
        """Per data-parallel rank, its share of ``rows`` in token-budget micro-batches (global row ids; same
        answer on every rank, empty for a rank without rows)."""
        return [self._plan(share, lengths, budget) for share in self._dp_shares(lengths, rows)]

    def _plan(self, rows: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
        """``rows`` grouped into token-budget micro-batches (global row ids)."""
        groups = plan_micro_batches([lengths[r] for r in rows], budget, padded=not self.config.trainer.sequence_packing)
        return [[rows[i] for i in g] for g in groups]

    def _build(self, batch, plan: Sequence[Sequence[int]], stand_ins: int = 0) -> list:
        """Micro-batches of ``plan``, then ``stand_ins`` stand-in micro-batches (:attr:`MicroBatch.stand_in`)."""
        packed, multiple = self.config.trainer.sequence_packing, self.config.sequence_multiple
        routed = self._routed_experts(batch)
        built = [build_micro_batch(rows, batch.prompt_ids, batch.response_ids, packed=packed, pad_to_multiple=multiple,
                                   routed_experts=routed) for rows in plan]
        if stand_ins:
            lengths = _lengths(batch.prompt_ids, batch.response_ids)
            shortest = min(range(len(lengths)), key=lambda r: (lengths[r], r))
            extra = build_micro_batch([shortest], batch.prompt_ids, batch.response_ids, packed=packed,
                                      pad_to_multiple=multiple, routed_experts=routed)
            built += [dataclasses.replace(extra, stand_in=True) for _ in range(stand_ins)]
        return built

    def _routed_experts(self, batch) -> list[torch.Tensor] | None:
        """Per row, the engine's routed experts (T_i, L, K) with routing replay on; None when off.

        Raises:
            ValueError: routing replay on and the batch has no ``extras["routed_experts"]``."""
        if self.replay is None:
            return None
        routed = batch.extras.get(ROUTED_EXPERTS)
        if routed is None:
            raise ValueError("algorithm.router_replay='rollout' but the batch has no extras['routed_experts'] (the "
                             "rollout engine returns them with EngineConfig.return_routed_experts)")
        return [torch.as_tensor(r) for r in routed]

    def _expert_parallel_stand_ins(self, plans: Sequence[Sequence[Sequence[int]]], mine: int) -> int:
        """Stand-in micro-batches this rank adds so that it runs as many as every other data-parallel rank (with
        expert parallelism: every MoE layer's dispatch is a collective of the expert-parallel group); 0 without."""
        if parallel_state.get_expert_model_parallel_world_size() == 1:
            return 0
        return max(len(plan) for plan in plans) - mine

    def _forward(self, batch, *, reference: bool, with_entropy: bool):
        if reference and not self.config.loss.use_kl_loss:
            raise ValueError("compute_log_probs(reference=True) but loss.use_kl_loss=False (no reference model)")
        if reference and self.config.lora.enabled:
            with lora.adapters_disabled(self.model_chunks):
                return self._forward_chunks(self.model_chunks, batch, with_entropy=with_entropy, replay=self.replay)
        chunks = self.reference_chunks if reference else self.model_chunks
        replay = self.reference_replay if reference else self.replay
        out = self._forward_chunks(chunks, batch, with_entropy=with_entropy, replay=replay)
        if replay is not None and not reference:
            self.router_metrics = replay.metrics(self.device)
        return out

    def _forward_chunks(self, chunks, batch, *, with_entropy: bool, replay: ReplayedRouters | None = None):
        lengths = _lengths(batch.prompt_ids, batch.response_ids)
        resp = [int(r.numel()) for r in batch.response_ids]
        budget = self.config.trainer.log_prob_micro_batch_tokens
        plans = self._dp_plans(lengths, range(len(lengths)), budget)
        dp_rank = parallel_state.get_data_parallel_rank()
        head = self._head(with_entropy=with_entropy, entropy_grad=False)
        # A rank without rows skips the pass; so does its whole model-parallel group (same data-parallel rank),
        # unless expert parallelism keeps it in step with its peers (stand-in micro-batches, outputs dropped).
        outputs = []
        stand_ins = self._expert_parallel_stand_ins(plans, len(plans[dp_rank]))
        if plans[dp_rank] or stand_ins:
            outputs = run_forward_only(chunks, self._build(batch, plans[dp_rank], stand_ins), head, self.device, replay)
            outputs = outputs[: len(plans[dp_rank])]  # the last stage's; empty elsewhere
        fields = ["log_probs"] + (["entropy"] if with_entropy else [])
        results = self._gather_rows(plans, outputs, fields, resp)
        return results["log_probs"], results.get("entropy")

    def _gather_rows(
        self, plans: Sequence[Sequence[Sequence[int]]], outputs: Sequence[dict[str, torch.Tensor]],
        fields: Sequence[str], resp: Sequence[int],
    ) -> dict[str, list[torch.Tensor | None]]:
        """Per-token values of every data-parallel rank's rows, on every rank (a collective).

        Args:
            plans: per data-parallel rank, its micro-batches' global row ids (same on every rank).
            outputs: this rank's per-micro-batch ``{field: (N_mb,)}`` in ``plans[dp_rank]`` order on the last
                pipeline stage; empty on other stages (their values come from the last stage).
            fields: the keys to gather.
            resp: response length of every row of the batch.

        Returns:
            ``{field: per row float32 (R_i,) on the CPU}``; None for a row no plan holds.
        """
        dp_rank = parallel_state.get_data_parallel_rank()
        # every rank's values, rows in micro-batch order, fields interleaved per token: (tokens, fields)
        sizes = [sum(resp[r] for mb in plan for r in mb) * len(fields) for plan in plans]
        flat = torch.zeros(sizes[dp_rank], dtype=torch.float32)
        if outputs:  # last pipeline stage
            flat = torch.cat([torch.stack([out[f] for f in fields], dim=-1).reshape(-1) for out in outputs])
        if sizes[dp_rank]:
            flat = self._broadcast_from_last_stage(flat)
        results: dict[str, list[torch.Tensor | None]] = {f: [None] * len(resp) for f in fields}
        for plan, values in zip(plans, self._all_gather_dp(flat, sizes)):
            values = values.view(-1, len(fields))
            offset = 0
            for r in (r for mb in plan for r in mb):
                for k, f in enumerate(fields):
                    results[f][r] = values[offset : offset + resp[r], k].clone()
                offset += resp[r]
        return results

    def _broadcast_from_last_stage(self, flat: torch.Tensor) -> torch.Tensor:
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return flat
        buf = flat.to(self.device)
        dist.broadcast(
            buf,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return buf.cpu()

    def _all_gather_dp(self, flat: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        if len(sizes) == 1:
            return [flat]
        longest = max(max(sizes), 1)
        buf = torch.zeros(longest, dtype=torch.float32, device=self.device)
        buf[: flat.numel()] = flat.to(self.device)
        parts = [torch.empty_like(buf) for _ in sizes]
        dist.all_gather(parts, buf, group=parallel_state.get_data_parallel_group())
        return [p[:n].cpu() for p, n in zip(parts, sizes)]

    # ------------------------------------------------------------------ update
    def update(
        self,
        batch,
        row_advantages: torch.Tensor,
        old_log_probs: Sequence[torch.Tensor] | None,
        ref_log_probs: Sequence[torch.Tensor] | None = None,
    ) -> tuple[dict[str, float], list[torch.Tensor]]:
        """Policy update (PPO, or supervised NLL with ``loss.policy_loss="nll"``): ``ppo_epochs`` passes, one
        optimizer step per mini-batch of ``ppo_mini_batch_size`` rows.

        The LR schedule advances once per call (one training iteration, verl's unit for
        ``lr_warmup_steps``), before the first step: update k (1-based) trains at the schedule's LR at k, so
        warmup starts at ``lr / warmup`` and the schedule does not depend on how many rows an iteration has.

        On-policy update (``old_log_probs=None``, as verl's dp_actor does): allowed only when the update takes
        exactly one optimizer step (:func:`~megatron_gigpo.actor.batching.update_is_on_policy`: one epoch, every
        row in one mini-batch), where the behaviour policy is the current one. The loss then uses each
        micro-batch's own detached log-probs as old log-probs (ratio exactly 1, so ``pg_clipfrac`` and
        ``ppo_kl`` are 0), which saves :meth:`compute_log_probs`' forward pass; the log-probs computed before
        the step are returned for the caller's diagnostics. They come from the training forward pass
        (``micro_batch_tokens`` budget, train mode), so they equal :meth:`compute_log_probs` up to float
        rounding (and LoRA dropout, if enabled).

        Args:
            batch: the training batch (same on every rank); rows are ``(trajectory, step)``.
            row_advantages: float32 (rows,), one advantage per row (from ``algo.advantages``).
            old_log_probs: per row float32 (R_i,), behaviour-policy log-probs; None for an on-policy update. With
                ``trainer.old_log_probs: rollout`` the caller passes the engines' (``batch.rollout_log_probs``).
            ref_log_probs: per row float32 (R_i,) reference log-probs; required iff ``loss.use_kl_loss``.

        With ``loss.rollout_correction.mode`` other than ``none`` each token's policy loss is weighted by the
        mismatch correction of the actor's old log-probs and ``batch.rollout_log_probs``
        (:mod:`megatron_gigpo.algo.rollout_correction`).

        Returns:
            ``(metrics, old_log_probs)`` in both modes. ``metrics``: ``actor/<metric>`` means over the
            optimizer steps of this call (``loss``, ``entropy``, ``kl_loss``, ``grad_norm``, ``update_skipped``
            and the policy loss's own metrics: ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``
            for ``vanilla``, ``nll`` for ``nll``; ``moe_aux_loss``, the load-balancing loss of a MoE policy with
            ``moe_aux_loss_coeff > 0``: :mod:`.moe_metrics`), ``actor/lr`` of the last step and
            ``actor/num_optimizer_steps``. ``old_log_probs``: the behaviour log-probs the loss used, per row
            float32 (R_i,) (the format of :meth:`compute_log_probs`): the given tensors themselves (in a new
            list) when ``old_log_probs`` was given; on-policy, the policy's log-probs before the step, on the
            CPU and identical on every rank.

        A mini-batch with fewer rows than data-parallel ranks (the short last one of an epoch, or a batch of
        one row) still takes one optimizer step on every rank: a rank without rows runs a stand-in row whose
        loss is multiplied by zero (:attr:`MiniBatchPlan.stand_in`), so the gradient reduction and the optimizer
        collectives see every rank and the step equals that of the real rows alone.

        Raises:
            ValueError: inputs disagree with the batch (row count, response lengths, missing reference), or
                ``old_log_probs`` is None while the update is not on-policy (``ppo_epochs > 1`` or more rows
                than ``ppo_mini_batch_size``).
        """
        engine_old = old_log_probs is not None and self.config.trainer.old_log_probs == "rollout"
        rows = RowData(
            old_log_probs=old_log_probs, advantages=row_advantages.float().cpu(), ref_log_probs=ref_log_probs,
            rollout_log_probs=batch.rollout_log_probs if self.config.loss.rollout_correction.mode != "none" else None,
            old_is_rollout=engine_old,
        )
        self._check_update_inputs(batch, rows)
        lengths = _lengths(batch.prompt_ids, batch.response_ids)
        resp = [int(r.numel()) for r in batch.response_ids]
        generator = None
        if self.config.trainer.shuffle:
            generator = torch.Generator().manual_seed(self.config.trainer.seed * 1_000_003 + self.update_calls)
        head = self._head(with_entropy=True, entropy_grad=self.config.loss.entropy_coeff != 0)
        per_step: list[dict[str, float]] = []
        self.scheduler.step(increment=1)
        for _ in range(self.config.trainer.ppo_epochs):
            for mini in split_mini_batches(len(lengths), self.config.trainer.ppo_mini_batch_size, generator):
                plan, row_plans = self._mini_batch_plan(batch, lengths, resp, mini)
                step_metrics, step_log_probs = train_mini_batch(
                    self.model_chunks, self.optimizer, plan, rows, self.config.loss, head, self.device, self.replay
                )
                per_step.append(step_metrics)
        self.update_calls += 1
        self.optimizer_steps += len(per_step)
        keys = sorted({k for m in per_step for k in m} - {"lr"})
        out = {f"actor/{k}": sum(m[k] for m in per_step if k in m) / sum(1 for m in per_step if k in m) for k in keys}
        out["actor/lr"] = per_step[-1]["lr"]
        out["actor/num_optimizer_steps"] = float(len(per_step))
        if self.replay is not None:  # over every forward of this update (recomputed layers count again)
            out |= self.replay.metrics(self.device)
        if old_log_probs is not None:
            return out, list(old_log_probs)
        # on-policy: one step, whose micro-batches computed every row's log-probs before it
        gathered = self._gather_rows(row_plans, [{"log_probs": t} for t in step_log_probs], ["log_probs"], resp)
        return out, gathered["log_probs"]

    def _mini_batch_plan(
        self, batch, lengths: Sequence[int], resp: Sequence[int], mini: Sequence[int]
    ) -> tuple[MiniBatchPlan, list[list[list[int]]]]:
        """This rank's :class:`MiniBatchPlan` of mini-batch ``mini`` (global row ids), and every data-parallel
        rank's micro-batch row ids (empty for a rank without rows)."""
        row_plans = self._dp_plans(lengths, mini, self.config.trainer.micro_batch_tokens)
        mine = row_plans[parallel_state.get_data_parallel_rank()]
        stand_in = not mine
        if stand_in:  # fewer rows than data-parallel ranks: the shortest row, weighted zero
            mine = [[min(mini, key=lambda r: (lengths[r], r))]]
        plan = MiniBatchPlan(
            micro_batches=self._build(batch, mine, self._expert_parallel_stand_ins(row_plans, len(mine))),
            total_tokens=sum(resp[r] for r in mini),
            total_sequences=sum(1 for r in mini if resp[r] > 0),
            stand_in=stand_in,
        )
        return plan, row_plans

    def _check_update_inputs(self, batch, rows: RowData) -> None:
        n = len(batch.response_ids)
        if rows.advantages.shape != (n,):
            raise ValueError(f"row_advantages has shape {tuple(rows.advantages.shape)}, expected ({n},)")
        if rows.old_log_probs is None and not update_is_on_policy(n, self.config.trainer):
            raise ValueError(
                f"old_log_probs=None (on-policy update) needs one optimizer step, but trainer.ppo_epochs="
                f"{self.config.trainer.ppo_epochs} and {n} rows with trainer.ppo_mini_batch_size="
                f"{self.config.trainer.ppo_mini_batch_size} take more: pass compute_log_probs' old log-probs"
            )
        named = [("old_log_probs", rows.old_log_probs)] if rows.old_log_probs is not None else []
        if self.config.loss.use_kl_loss:
            if rows.ref_log_probs is None:
                raise ValueError("loss.use_kl_loss=True but ref_log_probs is None")
            named.append(("ref_log_probs", rows.ref_log_probs))
        for name, values in named:
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} rows, the batch has {n}")
            for i, (v, r) in enumerate(zip(values, batch.response_ids)):
                if v.numel() != r.numel():
                    raise ValueError(f"{name}[{i}] has {v.numel()} values, response_ids[{i}] has {r.numel()}")

    # ------------------------------------------------------------------ checkpoints and weights
    def _checkpoint_state(self) -> CheckpointState:
        return CheckpointState(self.model_chunks, self.optimizer, self.scheduler,
                               adapters_only=self.config.lora.enabled)

    def _write_sidecar(self, folder) -> None:
        write_model_sidecar(folder, model=self.model_chunks, hf_dir=self.config.model_path)
        if self.config.lora.enabled:
            from megatron_gigpo.actor.lora_files import write_lora_reference

            write_lora_reference(folder, self.config.lora, self.config.model_path)

    def _check_checkpoint(self, folder) -> None:
        from megatron_gigpo.actor.lora_files import check_lora_reference

        check_lora_reference(folder, self.config.lora, self.config.model_path)

    def save_checkpoint(self, root: str, iteration: int, trainer_state: dict[str, Any], *, keep_last: int = 3) -> str:
        """Save model, optimizer, LR schedule, RNG, actor counters and ``trainer_state``; collective.

        Written to ``root/iter_XXXXXXXX.tmp`` then renamed (see :mod:`.checkpoint`); keeps ``keep_last``.
        The folder also holds the HF sidecar (``hf/``, ``megatron_gigpo.json``), so ``megatron-gigpo convert
        megatron-to-hf --megatron-dir <folder>`` exports the trained policy. With LoRA only the adapters (and
        their optimizer state) are saved, plus ``lora.json`` naming the base (:mod:`.lora_files`). Returns the
        final folder.
        """
        actor_state = {"update_calls": self.update_calls, "optimizer_steps": self.optimizer_steps}
        path = save_actor_checkpoint(
            root, iteration, self._checkpoint_state(), actor_state=actor_state, trainer_state=trainer_state,
            keep_last=keep_last,
            model_sidecar=self._write_sidecar,
        )
        return str(path)

    def load_checkpoint(self, root: str) -> dict[str, Any] | None:
        """Resume from the newest complete checkpoint under ``root`` (any TP / PP / DP layout); collective.

        Returns:
            The ``trainer_state`` saved with it, or None when ``root`` has no complete checkpoint.

        Raises:
            ValueError: a LoRA checkpoint into a full-weight actor or the reverse, or another LoRA rank,
                targets or base model (:func:`.lora_files.check_lora_reference`).
        """
        loaded = load_actor_checkpoint(root, self._checkpoint_state(), check_folder=self._check_checkpoint)
        if loaded is None:
            return None
        self.update_calls = int(loaded["actor_state"]["update_calls"])
        self.optimizer_steps = int(loaded["actor_state"]["optimizer_steps"])
        return loaded["trainer_state"]

    def save_hf_model(self, out_dir: str, *, max_shard_bytes: int = 5 * 10**9) -> str:
        """Write the policy as a Hugging Face model directory (safetensors in ``params_dtype``, config and
        tokenizer files of ``model_path``), atomically; collective over all ranks.

        See :func:`megatron_gigpo.actor.convert.write_hf_model`. Returns ``out_dir``.

        Raises:
            FileExistsError: ``out_dir`` exists and is not empty.
        """
        from megatron_gigpo.actor.convert import write_hf_model

        write_hf_model(self.model_chunks, out_dir, hf_config_dir=self.config.model_path,
                       max_shard_bytes=max_shard_bytes)
        return out_dir

    def set_adapter_weights(self, make) -> None:
        """Overwrite the LoRA adapters from full (all-TP) matrices (:func:`.lora.set_full_adapter_weights`'s
        ``make(layer_name, "A" | "B", full_shape)``) and refresh the optimizer's fp32 main copies (bf16), which
        would otherwise put the old adapters back at the next step. Call on every rank.

        Raises:
            ValueError: LoRA is not enabled, or a matrix of the wrong shape.
        """
        if not self.config.lora.enabled:
            raise ValueError("set_adapter_weights needs lora.enabled=True")
        lora.set_full_adapter_weights(self.model_chunks, make)
        self.optimizer.reload_model_params()

    def save_peft_adapter(self, out_dir: str) -> str:
        """Write the LoRA adapters as a Hugging Face PEFT folder for ``model_path`` (collective; see
        :func:`.lora_files.write_peft_adapter`). Returns ``out_dir``.

        Raises:
            ValueError: LoRA is not enabled.
        """
        if not self.config.lora.enabled:
            raise ValueError("save_peft_adapter needs lora.enabled=True")
        from megatron_gigpo.actor.lora_files import write_peft_adapter

        write_peft_adapter(self.model_chunks, out_dir, self.config.lora, base_model=self.config.model_path)
        return out_dir

    def export_weights(
        self, bucket_size_bytes: int, *, dtype: torch.dtype | None = None, destination: str = "rank0"
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named weight buckets of the policy; a collective every rank must consume to the end.

        Delegates to :func:`megatron_gigpo.models.weights.export_hf_weights` (see there for ``destination`` and which
        ranks receive tensors).
        """
        return export_hf_weights(
            self.model_chunks, bucket_size_bytes=bucket_size_bytes, dtype=dtype, destination=destination
        )

    def export_metadata(self, *, dtype: torch.dtype | None = None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(hf_name, dtype, shape)`` of every tensor :meth:`export_weights` yields, in order (same on every rank;
        a collective of the pipeline group: :func:`megatron_gigpo.models.weights.export_metadata`)."""
        return export_metadata(self.model_chunks, dtype=dtype)
