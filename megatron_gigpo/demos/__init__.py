"""Expert demonstrations for a supervised cold start before GiGPO (``megatron-gigpo demos``).

- :mod:`.experts`: the expert of an environment, which its module declares in ``RECIPE.expert`` (Sokoban: an
  optimal solver, :mod:`megatron_gigpo.envs.sokoban_solver`; ALFWorld: the game's walkthrough).
- :mod:`.writer`: :func:`write_demos` plays an expert through the RL collector's own per-step prompts and
  writes one chat row per step (JSONL, ``{"messages": [user, assistant], ...}``).
"""

from megatron_gigpo.demos.experts import Expert, ExpertMove, ExpertUnavailable, expert_env_names, make_expert
from megatron_gigpo.demos.writer import REASONING_MODES, DemoError, DemoStats, demo_tasks, write_demos

__all__ = [
    "REASONING_MODES",
    "DemoError",
    "DemoStats",
    "Expert",
    "ExpertMove",
    "ExpertUnavailable",
    "demo_tasks",
    "expert_env_names",
    "make_expert",
    "write_demos",
]
