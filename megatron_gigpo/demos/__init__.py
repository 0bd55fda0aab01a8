"""Expert demonstrations for a supervised cold start before GiGPO (``megatron-gigpo demos``).

- :mod:`.experts`: the expert of an environment, which its module declares in ``RECIPE.expert`` (Sokoban: an
  optimal solver, :mod:`megatron_gigpo.envs.sokoban_solver`; ALFWorld: the game's walkthrough).
- :mod:`.config`: the ``sft.demos`` settings (:class:`~.config.DemosConfig`).
- :mod:`.writer`: :func:`~.writer.write_demos` plays an expert through the RL collector's own per-step prompts and
  writes one chat row per step (JSONL, ``{"messages": [user, assistant], ...}``).
"""
