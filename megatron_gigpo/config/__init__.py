"""Typed recipe configuration: the recipe YAML mirrors a tree of dataclasses 1:1.

A recipe file may start from another with ``base: relative/path.yaml`` so each file is a small diff.
Command-line overrides use ``section.key=value`` (values parsed as YAML scalars/lists).

Each section is the settings dataclass of the component that uses it, declared with that component and passed
to it whole: ``model`` (:mod:`megatron_gigpo.models.config`); ``parallel``, ``actor`` (activation
recomputation) and ``optim`` (:mod:`megatron_gigpo.actor.config`, with ``algorithm`` as the policy loss and ``trainer`` for mini-batches and
token budgets: :class:`~megatron_gigpo.actor.config.ActorConfig`); ``algorithm`` (:mod:`megatron_gigpo.algo.config`,
also to the advantage estimators); ``rollout`` (:mod:`megatron_gigpo.rollout.config`, to the vLLM engines);
``env`` (:mod:`megatron_gigpo.episodes.config` plus ``env.<name>`` of each environment registered in
:mod:`megatron_gigpo.envs.registry`); ``trainer``, ``logging``, ``checkpoint`` (:mod:`megatron_gigpo.run.config`);
``sft`` (:mod:`megatron_gigpo.sft.config`, with ``sft.demos`` from :mod:`megatron_gigpo.demos.config`). Every field
has one definition, one default and one range or choice check (:func:`megatron_gigpo.fields.num` /
:func:`~megatron_gigpo.fields.choice`), run on the whole tree when a recipe is loaded.

This package only assembles: :mod:`.schema` (the root :class:`Config`), :mod:`.loading` (YAML, ``base:``, strict
keys, overrides, the atomic write of a resolved recipe) and :mod:`.validation` (checks across sections). Only
what is handed a whole :class:`Config` imports it: the CLI, the driver and the builders, and the SFT and
demonstration stages (``megatron_gigpo.sft.trainer``, ``.sft.cold_start``, ``megatron_gigpo.demos.writer``; the
builders and the SFT stage also write the resolved recipe with :func:`save_config`). The components that read
several sections (the placement and memory plans, the preflight, the metric sinks) state what they read as a
``Protocol`` of sections instead.

A new setting: a field with ``num(default, ge=...)`` / ``choice(default, names)`` in the section of the
component that reads it. A new nested section: a dataclass whose fields are declared the same way, added to its
parent as ``name: NewConfig = field(default_factory=NewConfig)``; loading, strict keys, overrides
(``section.name.key=value``), the range checks, ``config.yaml`` and the fuzz test all follow the tree.

Loading errors (:class:`ConfigError`) name the file, the key and, for a misspelled key, the closest valid key.
Cross-section checks (:func:`validate_config`) run before anything starts; checks that need the machine (data
directories, devices, services) live in :mod:`megatron_gigpo.cluster.preflight`.
"""

from megatron_gigpo.actor.config import LR_DECAY_STYLES, OptimConfig, ParallelConfig, RecomputeConfig
from megatron_gigpo.algo.config import AlgorithmConfig, DynamicSamplingConfig
from megatron_gigpo.config.loading import config_to_dict, load_config, parse_overrides, save_config
from megatron_gigpo.config.schema import Config, EnvConfig
from megatron_gigpo.config.validation import (
    ModelShape,
    group_relative_estimators,
    model_shape,
    recipe_fields,
    validate_config,
)
from megatron_gigpo.demos.config import DemosConfig
from megatron_gigpo.episodes.config import EpisodeConfig
from megatron_gigpo.fields import MAX_SEED, ConfigError, Range, choice, field_choices, field_errors, leaf_fields, num
from megatron_gigpo.models.config import LORA_TARGETS, PARAMS_DTYPES, ArchitectureConfig, LoraConfig, ModelConfig
from megatron_gigpo.rollout.config import RolloutConfig
from megatron_gigpo.run.config import MAX_TIMEOUT_S, CheckpointConfig, LoggingConfig, TimeoutsConfig, TrainerConfig
from megatron_gigpo.sft.config import SFTConfig

__all__ = [
    "Config", "EnvConfig", "ConfigError", "load_config", "save_config", "parse_overrides", "config_to_dict",
    "validate_config", "recipe_fields", "model_shape", "ModelShape",
    "group_relative_estimators",
    "ModelConfig", "ArchitectureConfig", "LoraConfig", "ParallelConfig", "RecomputeConfig", "OptimConfig",
    "RolloutConfig",
    "EpisodeConfig", "AlgorithmConfig", "DynamicSamplingConfig", "TrainerConfig", "TimeoutsConfig",
    "LoggingConfig", "CheckpointConfig", "SFTConfig", "DemosConfig",
    "PARAMS_DTYPES", "LORA_TARGETS", "LR_DECAY_STYLES", "MAX_SEED", "MAX_TIMEOUT_S",
    "Range", "num", "choice", "field_choices", "field_errors", "leaf_fields",
]
