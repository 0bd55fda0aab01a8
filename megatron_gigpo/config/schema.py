"""The recipe tree: :class:`Config`, one field per section, each section the settings dataclass that its
component declares (``model`` -> :mod:`megatron_gigpo.models.config`, ``parallel``, ``actor`` and ``optim`` ->
:mod:`megatron_gigpo.actor.config`, ``rollout`` -> :mod:`megatron_gigpo.rollout.config`, ``algorithm`` ->
:mod:`megatron_gigpo.algo.config`, ``trainer``, ``logging`` and ``checkpoint`` -> :mod:`megatron_gigpo.run.config`,
``sft`` -> :mod:`megatron_gigpo.sft.config`), and ``env``: the shared
:class:`~megatron_gigpo.episodes.config.EpisodeConfig` plus ``env.<section>`` of every registered environment
(:class:`EnvConfig`, assembled here from :mod:`megatron_gigpo.envs.registry`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from megatron_gigpo.actor.config import OptimConfig, ParallelConfig, RecomputeConfig
from megatron_gigpo.algo.config import AlgorithmConfig
from megatron_gigpo.episodes.config import EpisodeConfig
from megatron_gigpo.models.config import ModelConfig
from megatron_gigpo.rollout.config import RolloutConfig
from megatron_gigpo.run.config import CheckpointConfig, LoggingConfig, TrainerConfig
from megatron_gigpo.sft.config import SFTConfig

__all__ = ["EnvConfig", "Config"]


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


@dataclass
class Config:
    """A whole recipe: what ``megatron_gigpo.config.load_config`` returns and ``config.yaml`` of a run holds."""

    model: ModelConfig
    env: EnvConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    actor: RecomputeConfig = field(default_factory=RecomputeConfig)  # activation recomputation
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
