"""The ``env`` settings every environment shares (:class:`EpisodeConfig`): which environment, how many groups
an iteration collects, the episode length, the history shown in each step's prompt and the environment
workers. Each environment adds its own ``env.<section>`` (declared in its module, :mod:`megatron_gigpo.envs`);
:mod:`megatron_gigpo.config` assembles the two into the recipe's ``env`` section, which the collector, the
demonstration writer and the environment registry receive whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gigpo.episodes.templates import PROMPT_STYLES
from megatron_gigpo.fields import MAX_SEED, choice, num

__all__ = ["EpisodeConfig"]


@dataclass
class EpisodeConfig:
    """The ``env`` settings every environment shares; ``megatron_gigpo.config.EnvConfig`` adds one sub-section
    per environment."""

    # a name registered in megatron_gigpo.envs.registry
    name: str = field(metadata={"choices": "megatron_gigpo.envs.registry:ENVIRONMENTS"})
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
    # seconds each environment step call waits before returning (every worker at once, no core used): simulates a
    # remote environment or tool server, e.g. to measure asynchronous rollout (megatron_gigpo.episodes.workers)
    step_latency_s: float = num(0.0, ge=0)
