"""Expert demonstrations for a supervised cold start before GiGPO (``megatron-gigpo demos``).

- :mod:`.sokoban_solver`: an optimal (breadth-first) Sokoban solver on the environment's text grid.
- :mod:`.experts`: expert policies by environment name (Sokoban solver, ALFWorld walkthrough).
- :mod:`.writer`: :func:`write_demos` plays an expert through the RL collector's own per-step prompts and
  writes one chat row per step (JSONL, ``{"messages": [user, assistant], ...}``).
"""

from megatron_gigpo.demos.experts import EXPERTS, Expert, ExpertMove, ExpertUnavailable, make_expert
from megatron_gigpo.demos.writer import REASONING_MODES, DemoError, DemoStats, demo_tasks, write_demos

__all__ = [
    "EXPERTS",
    "REASONING_MODES",
    "DemoError",
    "DemoStats",
    "Expert",
    "ExpertMove",
    "ExpertUnavailable",
    "demo_tasks",
    "make_expert",
    "write_demos",
]
