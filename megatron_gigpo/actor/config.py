"""The actor's settings: the recipe's ``parallel`` (:class:`ParallelConfig`) and ``optim``
(:class:`OptimConfig`) sections, and :class:`ActorConfig`, what one Megatron actor rank
(:class:`megatron_gigpo.actor.policy.PolicyActor`) is built from: those sections, ``algorithm`` as the policy loss,
``trainer`` (mini-batches, token budgets, shuffling, packing, the log-prob chunk, the seed) and ``model.lora``,
each passed whole, plus the few values the driver derives at run time
(:func:`megatron_gigpo.builders.actor_config`).

Every section's fields, defaults and range checks are defined once, with the section;
:meth:`ActorConfig.validate` runs those same checks (:func:`megatron_gigpo.fields.field_errors`). This module
imports no torch: the recipe loader reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_gigpo.algo.config import AlgorithmConfig
from megatron_gigpo.fields import choice, field_errors, num
from megatron_gigpo.models.config import PARAMS_DTYPES, LoraConfig
from megatron_gigpo.run.config import TrainerConfig

if TYPE_CHECKING:
    import torch

__all__ = ["LR_DECAY_STYLES", "RECOMPUTE_GRANULARITIES", "RECOMPUTE_METHODS", "ParallelConfig", "RecomputeConfig",
           "OptimConfig", "ActorConfig", "model_layout_errors"]

LR_DECAY_STYLES = ("constant", "linear", "cosine")  # Megatron OptimizerParamScheduler styles used here
RECOMPUTE_GRANULARITIES = ("selective", "full")  # megatron-core TransformerConfig.recompute_granularity (or null)
RECOMPUTE_METHODS = ("uniform", "block")  # TransformerConfig.recompute_method (full granularity only)


@dataclass
class ParallelConfig:
    """Megatron layout of the actor. TP x PP x DP actor ranks = trainer.nnodes x trainer.devices_per_node; with
    GPU engines in ``rollout.weight_sync_mode: disaggregated`` the engines' GPUs come out of that count
    (:mod:`megatron_gigpo.cluster.placement`). ``data_parallel_size: auto`` (or null): the rest of the world,
    world / (TP x PP), as Megatron derives it, decided when the recipe is loaded
    (:func:`megatron_gigpo.config.validation.resolve_auto_sizes`); a loaded recipe always holds a number."""

    tensor_model_parallel_size: int = num(1, ge=1)
    pipeline_model_parallel_size: int = num(1, ge=1)
    data_parallel_size: int | None = num(1, ge=1, auto=True)
    use_distributed_optimizer: bool = False
    # Megatron's sequence parallelism (Korthikanti et al. 2022): the norms, residuals and the layer inputs the
    # linear layers keep for backward are split over the TP ranks along the sequence (activations of those parts
    # / TP). Needs tensor_model_parallel_size > 1; not with LoRA adapters.
    sequence_parallel: bool = False
    # Mixture-of-experts models only: each of EP ranks holds num_experts / EP experts of every MoE layer (megatron-core
    # expert parallelism: the experts' ranks are carved out of the data-parallel ranks, so expert TP x EP x PP must
    # divide the world); expert_tensor_parallel_size splits each expert's linear layers (null: megatron-core's
    # default, tensor_model_parallel_size)
    expert_model_parallel_size: int = num(1, ge=1)
    expert_tensor_parallel_size: int | None = num(None, ge=1)

    @property
    def expert_tensor_parallel(self) -> int:
        """The experts' TP size megatron-core uses: ``expert_tensor_parallel_size``, or the TP size when null."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size


@dataclass
class RecomputeConfig:
    """The recipe's ``actor`` section: activation recomputation of the actor's Megatron model, passed as is to
    megatron-core's ``TransformerConfig`` (the same names and rules; :func:`model_layout_errors`).

    ``recompute_granularity``: null keeps every activation; ``selective`` recomputes the core attention in backward
    (Megatron's default ``recompute_modules: [core_attn]``: the softmax probabilities, the s x s term; nothing to
    gain with Transformer-Engine's fused attention, which keeps none); ``full`` keeps only the input of each group
    of layers and recomputes the layers in backward (about one more forward pass of compute).
    ``recompute_method`` (full only): ``uniform`` splits the layers of a pipeline stage into groups of
    ``recompute_num_layers`` and keeps each group's input; ``block`` recomputes the first ``recompute_num_layers``
    layers of each stage and keeps the rest whole. Activations per GPU: :mod:`megatron_gigpo.cluster.activations`.
    """

    recompute_granularity: str | None = choice(None, RECOMPUTE_GRANULARITIES)
    recompute_method: str | None = choice(None, RECOMPUTE_METHODS)
    recompute_num_layers: int | None = num(None, ge=1)  # full: 1 .. layers per pipeline stage


def model_layout_errors(parallel: ParallelConfig, recompute: RecomputeConfig, *, lora_keys: tuple[str, ...] = (),
                        layers_per_stage: int | None = None, recompute_key: str = "actor") -> list[str]:
    """The rules megatron-core 0.16 (``TransformerConfig.__post_init__``, ``ModelParallelConfig``) and the actor
    set on ``parallel.sequence_parallel`` and ``recompute``, as messages naming the keys (empty: valid).

    Args:
        lora_keys: the LoRA sections that are enabled (``("model.lora",)``): their adapters do not support
            sequence parallelism (:mod:`megatron_gigpo.actor.lora`).
        layers_per_stage: decoder layers per pipeline stage, when known (upper bound of recompute_num_layers).
        recompute_key: the section the recompute settings are read from, for the messages.
    """
    errors = []
    if parallel.sequence_parallel and parallel.tensor_model_parallel_size < 2:
        errors.append(f"parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1 "
                      f"(got {parallel.tensor_model_parallel_size}): it splits the tensor-parallel ranks' activations")
    if parallel.sequence_parallel:
        errors += [f"parallel.sequence_parallel=true is not supported with {key}.enabled=true (LoRA adapters)"
                   for key in lora_keys]
    r, k = recompute, recompute_key
    if r.recompute_granularity == "full":
        if r.recompute_method is None:
            errors.append(f"{k}.recompute_granularity=full needs {k}.recompute_method "
                          f"({' or '.join(RECOMPUTE_METHODS)})")
        if r.recompute_num_layers is None:
            errors.append(f"{k}.recompute_granularity=full needs {k}.recompute_num_layers (layers per recomputed "
                          f"group, uniform; or recomputed layers per pipeline stage, block)")
        elif layers_per_stage is not None and r.recompute_num_layers > layers_per_stage:
            errors.append(f"{k}.recompute_num_layers={r.recompute_num_layers} must be at most the "
                          f"{layers_per_stage} layers of a pipeline stage")
    else:
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(r, name) is not None:
                errors.append(f"{k}.{name}={getattr(r, name)!r} is only read with {k}.recompute_granularity=full "
                              f"(got {r.recompute_granularity!r}); set it to null")
    return errors


@dataclass
class OptimConfig:
    """Adam with decoupled weight decay and its LR schedule (Megatron ``OptimizerConfig`` +
    ``OptimizerParamScheduler``); Megatron exempts biases and norms from weight decay."""

    lr: float = num(1e-6, gt=0)
    min_lr: float = num(0.0, ge=0)  # and <= lr
    weight_decay: float = num(0.01, ge=0)
    adam_beta1: float = num(0.9, ge=0, lt=1)
    adam_beta2: float = num(0.999, ge=0, lt=1)
    adam_eps: float = num(1e-8, gt=0)
    clip_grad: float = num(1.0, ge=0)  # 0: no clipping
    lr_warmup_steps: int = num(0, ge=0)  # training iterations (verl's unit); the schedule advances once per iteration
    lr_decay_style: str = choice("constant", LR_DECAY_STYLES)  # over trainer.total_iterations


@dataclass(frozen=True)
class ActorConfig:
    """Everything one actor rank needs.

    Attributes:
        model_path: Hugging Face model directory (config.json + safetensors) for policy and reference: the
            resolved ``model.path`` (:func:`megatron_gigpo.models.random_init.resolve_model`).
        params_dtype: ``float32`` | ``bfloat16`` (``model.dtype``; float32 on CPU); bf16 trains with fp32
            master weights (Megatron ``Float16OptimizerWithFloat16Params`` / ``DistributedOptimizer``).
        temperature: the rollout's sampling temperature (``rollout.temperature``); logits are divided by it.
        lr_decay_steps: the update (counted from the start, warmup included) at which the LR has decayed to
            ``optim.min_lr`` (RL: ``trainer.total_iterations``; SFT: its optimizer steps). Megatron needs it
            above ``optim.lr_warmup_steps``; the actor raises it to ``lr_warmup_steps + 1`` if not.
        parallel: the recipe's ``parallel`` (TP, PP, distributed optimizer, sequence parallelism; the rest of
            the world is DP).
        recompute: the recipe's ``actor`` section (activation recomputation, Megatron's settings).
        optim: the recipe's ``optim`` (Adam and LR schedule; ``lr_warmup_steps`` counts updates).
        loss: the recipe's ``algorithm`` (policy loss, clip ratios, KL, entropy, loss aggregation).
        trainer: the recipe's ``trainer`` (``ppo_mini_batch_size``, ``ppo_epochs``, ``micro_batch_tokens``,
            ``log_prob_micro_batch_tokens``, ``logprob_chunk_size``, ``shuffle``, ``sequence_packing``,
            ``seed``).
        lora: the recipe's ``model.lora`` (:mod:`megatron_gigpo.actor.lora`); when enabled the base weights are
            frozen, only the adapters train and the KL reference is the base (adapters off).
    """

    model_path: str
    params_dtype: str
    temperature: float
    lr_decay_steps: int
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    @classmethod
    def build(cls, model_path: str | Path, *, params_dtype: str = "float32", temperature: float = 1.0,
              lr_decay_steps: int = 1, lora: LoraConfig | None = None, **settings) -> "ActorConfig":
        """An actor config from recipe defaults and the settings named in ``settings`` by their field name
        (``build(path, tensor_model_parallel_size=2, lr=1e-3, kl_loss_coef=0.1, ppo_mini_batch_size=8)``), each
        routed to the one section that has it, and ``lora`` whole; for tests, benchmarks and code without a recipe.

        Raises:
            TypeError: a name that no section has.
        """
        names = {name: [f.name for f in dataclasses.fields(tp)] for name, tp in _SECTIONS.items()}
        changes: dict[str, dict] = {name: {} for name in _SECTIONS}
        for key, value in settings.items():
            owner = next((name for name, keys in names.items() if key in keys), None)
            if owner is None:
                raise TypeError(f"ActorConfig.build: no section has a setting {key!r} (sections: {', '.join(names)})")
            changes[owner][key] = value
        return cls(model_path=str(model_path), params_dtype=params_dtype, temperature=temperature,
                   lr_decay_steps=lr_decay_steps, lora=lora or LoraConfig(),
                   **{name: tp(**changes[name]) for name, tp in _SECTIONS.items()})

    @property
    def torch_dtype(self) -> "torch.dtype":
        """``params_dtype`` as a torch dtype (``torch.float32`` / ``torch.bfloat16``)."""
        import torch

        return getattr(torch, self.params_dtype)

    def validate(self, world_size: int | None = None) -> None:
        """The sections' own range and choice checks, the derived values, and the layout against ``world_size``.

        Raises:
            ValueError: naming every bad field and its value (``ActorConfig: loss.clip_ratio_c=0.5 must be > 1``).
        """
        errors = [f"{name}.{message}" for name in ("parallel", "recompute", "optim", "loss", "trainer", "lora")
                  for message in field_errors(getattr(self, name))]
        errors += model_layout_errors(self.parallel, self.recompute, lora_keys=("lora",) if self.lora.enabled else (),
                                      recompute_key="recompute")
        if self.params_dtype not in PARAMS_DTYPES:
            errors.append(f"params_dtype={self.params_dtype!r} is not one of {', '.join(PARAMS_DTYPES)}")
        if not self.temperature > 0:
            errors.append(f"temperature={self.temperature} must be > 0")
        if self.lr_decay_steps < 1:
            errors.append(f"lr_decay_steps={self.lr_decay_steps} must be >= 1")
        if not self.optim.min_lr <= self.optim.lr:
            errors.append(f"optim.min_lr={self.optim.min_lr} must be <= optim.lr={self.optim.lr}")
        if errors:
            raise ValueError("ActorConfig: " + "; ".join(errors))
        if world_size is None:
            return
        tp, pp = self.parallel.tensor_model_parallel_size, self.parallel.pipeline_model_parallel_size
        if world_size % (tp * pp):
            raise ValueError(f"ActorConfig: world size {world_size} is not divisible by tensor_model_parallel_size "
                             f"{tp} x pipeline_model_parallel_size {pp}")
        ep, etp = self.parallel.expert_model_parallel_size, self.parallel.expert_tensor_parallel
        if world_size % (etp * ep * pp):
            raise ValueError(f"ActorConfig: world size {world_size} is not divisible by expert_tensor_parallel_size "
                             f"{etp} x expert_model_parallel_size {ep} x pipeline_model_parallel_size {pp}")
        dp = world_size // (tp * pp)
        if self.trainer.ppo_mini_batch_size < dp:
            raise ValueError(
                f"ActorConfig: trainer.ppo_mini_batch_size={self.trainer.ppo_mini_batch_size} is smaller than the "
                f"data-parallel size {dp}; every data-parallel rank needs at least one row"
            )

    def transformer_overrides(self) -> dict:
        """The megatron-core ``TransformerConfig`` fields these settings set on the actor's model (policy and
        reference): ``sequence_parallel`` and the three ``recompute_*`` fields, under Megatron's own names."""
        return {"sequence_parallel": self.parallel.sequence_parallel,
                **{f.name: getattr(self.recompute, f.name) for f in dataclasses.fields(self.recompute)}}

    @property
    def sequence_multiple(self) -> int:
        """Micro-batches' sequence length is padded to a multiple of this: the TP size with sequence
        parallelism (Megatron splits the sequence over the TP ranks), else 1."""
        return self.parallel.tensor_model_parallel_size if self.parallel.sequence_parallel else 1

    def replace(self, **sections: dict) -> "ActorConfig":
        """A copy with some fields of some sections changed: ``replace(optim={"lr": 1e-3}, trainer={...})``;
        a non-dict value replaces a top-level field (``replace(temperature=1.0)``)."""
        changes = {name: dataclasses.replace(getattr(self, name), **value) if isinstance(value, dict) else value
                   for name, value in sections.items()}
        return dataclasses.replace(self, **changes)


_SECTIONS = {"parallel": ParallelConfig, "recompute": RecomputeConfig, "optim": OptimConfig, "loss": AlgorithmConfig,
             "trainer": TrainerConfig}
