"""Cross-field checks of a loaded recipe that need no machine resources (:func:`validate_config`); the
per-field ranges and choices are stated on the fields themselves (:mod:`megatron_gigpo.fields`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_gigpo.algo.config import off_policy_errors, router_replay_errors
from megatron_gigpo.cluster.placement import placement_errors
from megatron_gigpo.config.schema import Config
from megatron_gigpo.demos.experts import expert_env_names, no_expert_message
from megatron_gigpo.episodes.templates import prompt_templates
from megatron_gigpo.fields import ConfigError, field_errors, is_auto, leaf_fields
from megatron_gigpo.models.config import LORA_TARGETS, ArchitectureConfig, ModelConfig
from megatron_gigpo.models.specs import KNOWN_MODELS, hf_config_for, moe_shape
from megatron_gigpo.rollout.config import async_errors
from megatron_gigpo.sft.config import SFTConfig

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# Cross-field validation
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    num_attention_heads: int
    num_key_value_heads: int
    num_layers: int





def group_relative_estimators() -> tuple[str, ...]:
    """The registered advantage estimators that compare the N rollouts of a group (need ``rollout.n`` >= 2, can
    drive dynamic sampling): read from the registry (:data:`megatron_gigpo.algo.advantages.ADVANTAGE_ESTIMATORS`,
    ``register_advantage_estimator(name, group_relative=...)``), in registration order."""
    from megatron_gigpo.algo.advantages import GROUP_RELATIVE_ESTIMATORS  # torch: imported when a recipe is checked

    return tuple(GROUP_RELATIVE_ESTIMATORS)


def model_shape(path: str, revision: str | None = None) -> ModelShape:
    """Attention heads, KV heads and layers of ``model.path``: its config.json, local, in the Hugging Face cache
    or of a known id (:func:`megatron_gigpo.models.specs.hf_config_for`, so recipes validate without the weights).

    Raises:
        ConfigError: neither a directory with config.json, a cached hub id nor a known model id; a config.json
            that is not JSON or lacks a key the layout check needs.
    """
    try:
        hf = hf_config_for(path, revision)
    except ValueError as exc:  # a config.json that is not JSON
        raise ConfigError(str(exc)) from None
    if hf is None:
        from megatron_gigpo.models.hub import is_hub_id, missing_message

        if is_hub_id(path):
            raise ConfigError(missing_message(path, revision, f" and is not a known model id "
                                                          f"({', '.join(KNOWN_MODELS)})"))
        raise ConfigError(
            f"model.path '{path}': no config.json there and not a known model id ({', '.join(KNOWN_MODELS)})"
        )
    try:
        heads = int(hf["num_attention_heads"])
        return ModelShape(heads, int(hf["num_key_value_heads"] if "num_key_value_heads" in hf else heads),
                          int(hf["num_hidden_layers"]))
    except KeyError as exc:
        cfg_file = Path(os.path.expanduser(path)) / "config.json"
        raise ConfigError(f"{cfg_file}: missing {exc} needed to check the parallel layout") from None


def _policy_shape(m: ModelConfig) -> ModelShape:
    """Heads, KV heads and layers of the policy: ``architecture`` for ``init: random``, else :func:`model_shape`."""
    if m.init == "random":
        a = m.architecture
        return ModelShape(a.num_attention_heads, a.num_key_value_heads, a.num_hidden_layers)
    return model_shape(m.path, m.revision)


def _num_experts(m: ModelConfig) -> int | None:
    """Routed experts per layer of the policy (None: dense, or a config that cannot be read; the layout check
    reports the latter): ``model.architecture.num_experts`` for ``init: random``, else its config.json's."""
    if m.init == "random" and m.architecture.num_experts is not None:
        return m.architecture.num_experts
    try:
        hf = hf_config_for(m.path, m.revision)
    except ValueError:
        return None
    return moe_shape(hf or {})[0] or None


def _architecture_errors(a: ArchitectureConfig) -> list[str]:
    """Shape checks of ``model.architecture`` (used only with ``model.init: random``; ranges are per field)."""
    errors = []
    if a.hidden_size % a.num_attention_heads:
        errors.append(f"model.architecture.hidden_size={a.hidden_size} must be divisible by "
                      f"num_attention_heads={a.num_attention_heads}")
    if a.num_attention_heads % a.num_key_value_heads:
        errors.append(f"model.architecture.num_attention_heads={a.num_attention_heads} must be divisible by "
                      f"num_key_value_heads={a.num_key_value_heads}")
    return errors


def _value(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _revision_errors(m: ModelConfig) -> list[str]:
    """``model.revision`` pins a hub id's snapshot; on a local directory or builtin model it would be ignored."""
    from megatron_gigpo.models.hub import is_hub_id

    if m.revision is None:
        return []
    if not m.revision.strip():
        return [f"model.revision={m.revision!r} must be a branch, tag or commit hash, or null"]
    if is_hub_id(m.path):
        return []
    return [f"model.revision={m.revision!r} pins a Hugging Face hub id (Org/Name), but model.path '{m.path}' is a "
            f"local directory or builtin model; remove model.revision"]


def recipe_fields(cls: type = Config) -> typing.Iterator[tuple[str, dataclasses.Field, Any]]:
    """Every leaf setting of the recipe tree: ``(dotted key, dataclass field, type)``, depth first."""
    return leaf_fields(cls)


def resolve_auto_sizes(cfg: Config, source: str = "config") -> None:
    """Replace ``auto`` (None) in ``parallel.data_parallel_size`` and ``rollout.num_engines`` with the numbers
    that the recipe's devices give, in place, and log each. :func:`megatron_gigpo.config.load_config` calls it
    once, so every reader of a loaded recipe sees numbers (and ``config.yaml`` of a run holds them).

    With W = ``trainer.nnodes x trainer.devices_per_node`` devices, M = TP x PP and k =
    ``rollout.tensor_parallel_size``:

    - colocated, or on CPU (the actor ranks hold all W devices): DP = W / M, as Megatron derives it from the
      world size; engines = W / k, so the engines cover every GPU (verl's hybrid engine).
    - disaggregated on GPU (the engines' GPUs come out of W): DP = (W - engines x k) / M and engines =
      (W - M x DP) / k; the other of the two must be a number.

    Values outside their ranges are left for :func:`validate_config` to name.

    Raises:
        ConfigError: a size that does not divide, or both sizes ``auto`` when disaggregated; names the keys.
    """
    p, r, t = cfg.parallel, cfg.rollout, cfg.trainer
    m, k = p.tensor_model_parallel_size * p.pipeline_model_parallel_size, r.tensor_parallel_size
    sizes = (m, k, t.nnodes, t.devices_per_node, p.data_parallel_size or 1, r.num_engines or 1)
    if min(sizes) < 1:
        return  # validate_config names the value out of range
    world = t.nnodes * t.devices_per_node
    shape = f"trainer.nnodes={t.nnodes} x trainer.devices_per_node={t.devices_per_node}"
    gpu_split = t.device == "cuda" and r.weight_sync_mode != "colocated"
    if gpu_split and p.data_parallel_size is None and r.num_engines is None:
        raise ConfigError(f"{source}: parallel.data_parallel_size and rollout.num_engines are both auto with "
                          "rollout.weight_sync_mode=disaggregated: set one of them, the other takes the GPUs left")
    if p.data_parallel_size is None:
        left = world - r.num_engines * k if gpu_split else world
        what = (f"the {left} GPUs left of {world} ({shape}) after rollout.num_engines={r.num_engines} x "
                f"rollout.tensor_parallel_size={k}" if gpu_split else f"the world size {world} ({shape})")
        tp_pp = f"TP({p.tensor_model_parallel_size}) x PP({p.pipeline_model_parallel_size})"
        if left < m or left % m:
            raise ConfigError(f"{source}: parallel.data_parallel_size=auto needs {tp_pp} = {m} to divide {what}")
        p.data_parallel_size = left // m
        log.info("parallel.data_parallel_size: auto = %d (%s / %s)", p.data_parallel_size, what, tp_pp)
    if r.num_engines is None:
        actor = m * p.data_parallel_size
        left = world - actor if gpu_split else world
        what = (f"the {left} GPUs left of {world} ({shape}) after the actor's TP x PP x DP = {actor}" if gpu_split
                else f"the {world} devices ({shape})")
        if left < k or left % k:
            raise ConfigError(f"{source}: rollout.num_engines=auto needs rollout.tensor_parallel_size={k} to divide "
                              f"{what}")
        r.num_engines = left // k
        log.info("rollout.num_engines: auto = %d (%s / rollout.tensor_parallel_size=%d)", r.num_engines, what, k)


def validate_config(cfg: Config, source: str = "config") -> None:
    """Cross-field checks that need no machine resources. Raises ConfigError naming the keys."""
    errors = field_errors(cfg)
    if errors:  # the cross-field checks below assume every field in its range
        raise ConfigError(f"{source}: " + "; ".join(errors))
    unresolved = [key for key, f, _ in recipe_fields() if is_auto(f) and _value(cfg, key) is None]
    if unresolved:
        raise ConfigError(f"{source}: {', '.join(unresolved)} still auto: load the recipe with load_config, "
                          "which derives them (resolve_auto_sizes)")
    a, p, r, t = cfg.algorithm, cfg.parallel, cfg.rollout, cfg.trainer
    e = cfg.env
    if (e.name, e.prompt_template) not in prompt_templates():
        offered = sorted(s for n, s in prompt_templates() if n == e.name)
        errors.append(f"env.prompt_template={e.prompt_template!r} is not offered for env.name={e.name!r} "
                      f"(its templates: {', '.join(offered) or 'none'})")
    group_relative = group_relative_estimators()
    if a.adv_estimator in group_relative and r.n < 2:
        errors.append(f"rollout.n={r.n}: group-relative estimator '{a.adv_estimator}' needs a group size >= 2")
    if a.dynamic_sampling.enabled and a.adv_estimator not in group_relative:
        errors.append(f"algorithm.dynamic_sampling.enabled=true needs a group-relative estimator "
                      f"({', '.join(group_relative)}), got algorithm.adv_estimator={a.adv_estimator!r}")
    errors += off_policy_errors(a, t.old_log_probs, r.top_p, r.top_k)
    errors += async_errors(r, t, a)
    if cfg.model.init == "random":
        errors += _architecture_errors(cfg.model.architecture)
    errors += _revision_errors(cfg.model)
    for key, lora in (("model.lora", cfg.model.lora), ("sft.lora", cfg.sft.lora)):
        if lora.enabled and (not lora.target_modules or len(set(lora.target_modules)) != len(lora.target_modules)):
            errors.append(f"{key}.target_modules={lora.target_modules!r} must name each adapted layer once "
                          f"(of {', '.join(LORA_TARGETS)})")
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel
    if (tp * pp * dp) % (etp * ep * pp):
        errors.append(f"parallel.expert_tensor_parallel_size ({etp}) x expert_model_parallel_size ({ep}) x "
                      f"pipeline_model_parallel_size ({pp}) must divide the actor's {tp * pp * dp} ranks "
                      f"(TP x PP x DP): megatron-core carves the expert ranks out of them")
    # World size, engine GPUs and nodes: the placement plan's own check (one place decides where things run).
    errors += placement_errors(cfg)
    try:
        shape = _policy_shape(cfg.model)
    except ConfigError as exc:
        errors.append(str(exc))
    else:
        if shape.num_attention_heads % tp or shape.num_key_value_heads % tp:
            errors.append(
                f"parallel.tensor_model_parallel_size={tp} must divide the model's attention heads "
                f"({shape.num_attention_heads}) and KV heads ({shape.num_key_value_heads}) of '{cfg.model.path}'"
            )
        if shape.num_layers % pp:
            errors.append(
                f"parallel.pipeline_model_parallel_size={pp} must divide the model's {shape.num_layers} layers"
            )
        else:
            errors += _model_layout_errors(cfg, shape.num_layers // pp)
        if shape.num_attention_heads % r.tensor_parallel_size or shape.num_key_value_heads % r.tensor_parallel_size:
            errors.append(f"rollout.tensor_parallel_size={r.tensor_parallel_size} must divide the attention and KV heads")
    errors += _context_errors(cfg)
    errors += _expert_errors(cfg)
    errors += _engine_expert_errors(cfg)
    if a.router_replay != "off":
        errors += router_replay_errors(a.router_replay, num_experts=_num_experts(cfg.model), model=cfg.model.path,
                                       pipeline_stages=pp, recompute_granularity=cfg.actor.recompute_granularity)
    if t.ppo_mini_batch_size % dp:
        errors.append(f"trainer.ppo_mini_batch_size={t.ppo_mini_batch_size} must be divisible by DP={dp}")
    if (cfg.env.num_groups * r.n) % r.num_engines:
        errors.append(
            f"env.num_groups x rollout.n = {cfg.env.num_groups * r.n} episodes must divide evenly over "
            f"rollout.num_engines={r.num_engines}"
        )
    if not cfg.optim.min_lr <= cfg.optim.lr:
        errors.append(f"optim.min_lr={cfg.optim.min_lr} must be in [0, optim.lr={cfg.optim.lr}]")
    if not t.experiment_name.strip() or Path(t.experiment_name).name != t.experiment_name:
        errors.append(f"trainer.experiment_name={t.experiment_name!r} must be a plain, non-empty folder name")
    for key in ("micro_batch_tokens", "log_prob_micro_batch_tokens"):
        if getattr(t, key) < r.prompt_length + r.response_length:
            errors.append(
                f"trainer.{key}={getattr(t, key)} is smaller than one row "
                f"(rollout.prompt_length + rollout.response_length = {r.prompt_length + r.response_length})"
            )
    errors += _sft_errors(cfg.sft, dp, e.name)
    if errors:
        raise ConfigError(f"{source}: " + "; ".join(errors))


def _model_layout_errors(cfg: Config, layers_per_stage: int) -> list[str]:
    """Sequence parallelism and recomputation: the actor's own rules
    (:func:`megatron_gigpo.actor.config.model_layout_errors`), with the LoRA sections that are on (RL's
    ``model.lora``, the cold start's ``sft.lora``)."""
    from megatron_gigpo.actor.config import model_layout_errors

    loras = (("model.lora", cfg.model.lora), ("sft.lora", cfg.sft.lora))
    lora_keys = tuple(key for key, lora in loras if lora.enabled)
    return model_layout_errors(cfg.parallel, cfg.actor, lora_keys=lora_keys, layers_per_stage=layers_per_stage)


def _expert_errors(cfg: Config) -> list[str]:
    """Expert parallelism against the policy's experts (its config.json, or :data:`KNOWN_MODELS`;
    ``model.architecture.num_experts`` for ``init: random``): EP must divide the expert count (each EP rank holds
    num_experts / EP experts of every layer), a dense model takes no EP, and megatron-core's MoE layer trains
    with TP > 1 only under sequence parallelism; LoRA (dense layers only) is refused. An unknown model is not
    checked here (the shape check reports it)."""
    p, m = cfg.parallel, cfg.model
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    try:
        hf = hf_config_for(m.path, m.revision) or {}
    except ValueError:
        return []  # reported by _context_errors
    experts = _num_experts(m)
    if not hf and not experts:
        return []
    if not experts:
        return [f"parallel.expert_model_parallel_size={ep} needs a mixture-of-experts model; '{m.path}' is dense"
                ] if ep > 1 else []
    errors = []
    if experts % ep:
        errors.append(f"parallel.expert_model_parallel_size={ep} must divide the model's {experts} experts per layer")
    if m.lora.enabled:  # actor/lora.py adapts dense linear layers; expert layers are megatron-core's grouped MLPs
        errors.append(f"model.lora.enabled=true with a mixture-of-experts model ('{m.path}', {experts} experts per "
                      "layer): LoRA adapters on routed experts are not supported; set model.lora.enabled=false")
    if tp > 1 and not p.sequence_parallel:
        errors.append(f"parallel.tensor_model_parallel_size={tp} with a mixture-of-experts model needs "
                      f"parallel.sequence_parallel=true (megatron-core's MoE layer trains with TP only under it)")
    return errors


def _engine_expert_errors(cfg: Config) -> list[str]:
    """``rollout.enable_expert_parallel`` against the policy's experts and the device
    (:func:`megatron_gigpo.rollout.config.expert_parallel_errors`); a model whose config cannot be read is not
    checked here (the shape check reports it)."""
    from megatron_gigpo.rollout.config import expert_parallel_errors

    m, r = cfg.model, cfg.rollout
    experts = _num_experts(m)
    if r.enable_expert_parallel and experts is None and m.init != "random":
        try:
            if hf_config_for(m.path, m.revision) is None:
                return []
        except ValueError:
            return []
    return expert_parallel_errors(r, experts, cuda=cfg.trainer.device == "cuda", model=f"'{m.path}'")


def _context_errors(cfg: Config) -> list[str]:
    """The engines' context (``rollout.prompt_length + rollout.response_length``) within the model's
    ``max_position_embeddings`` (its config.json, or :data:`KNOWN_MODELS`; ``init: random`` keeps ``model.path``'s
    positions). vLLM refuses a longer ``max_model_len`` when the engine starts; an unknown limit is not checked."""
    try:
        hf = hf_config_for(cfg.model.path, cfg.model.revision)
    except ValueError as exc:
        return [f"model.path: {exc}"]
    limit = (hf or {}).get("max_position_embeddings")
    context = cfg.rollout.prompt_length + cfg.rollout.response_length
    if isinstance(limit, int) and context > limit:
        return [f"rollout.prompt_length + rollout.response_length = {context} tokens exceeds the "
                f"max_position_embeddings={limit} of model.path '{cfg.model.path}' (the engine's max_model_len)"]
    return []


def _sft_errors(s: SFTConfig, dp: int, env_name: str) -> list[str]:
    """Cross-field checks of the ``sft`` section (the ranges and choices are on its fields)."""
    errors = []
    if s.enabled and s.train_file is None:  # the cold start writes the environment's expert demonstrations first
        if env_name not in expert_env_names():
            errors.append(f"sft.enabled=true with sft.train_file null needs expert demonstrations, but "
                          f"{no_expert_message(env_name)}; set sft.train_file")
    if s.batch_size < dp:
        errors.append(f"sft.batch_size={s.batch_size} is smaller than DP={dp}: every data-parallel rank needs a row")
    if s.min_lr > s.lr:
        errors.append(f"sft.min_lr={s.min_lr} must be <= sft.lr={s.lr}")
    return errors

