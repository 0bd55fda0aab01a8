"""The ``sft.demos`` section (:class:`DemosConfig`): the expert demonstrations the cold start writes when
``sft.train_file`` is null (:func:`megatron_gigpo.demos.writer.write_demos`; ``megatron-gigpo demos`` takes the same
values as its defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gigpo.fields import MAX_SEED, choice, num

__all__ = ["REASONING_MODES", "DemosConfig"]

#: What an expert's reply holds in ``<think>``: ``plan``, the expert's short plan; ``none``, nothing.
REASONING_MODES: tuple[str, ...] = ("plan", "none")


@dataclass
class DemosConfig:
    """Expert demonstrations written for the cold start when ``sft.train_file`` is null
    (:func:`megatron_gigpo.demos.writer.write_demos`; ``megatron-gigpo demos`` takes the same values as defaults)."""

    num_episodes: int = num(1000, ge=1)  # training tasks played by the environment's expert
    epsilon: float = num(0.0, ge=0, le=1)  # share of steps taking a uniformly random admissible action instead (RL headroom)
    reasoning: str = choice("plan", REASONING_MODES)  # plan | none: the expert's short plan in <think>, or an empty <think>
    seed: int = num(0, ge=0, le=MAX_SEED)  # task order, resets and epsilon draws
