"""GiGPO algorithm core: pure tensor math, no I/O, no distributed state. Nothing is imported here: import
from the submodules (``megatron_gigpo.algo.advantages.compute_advantages``).

- :mod:`~megatron_gigpo.algo.config`: the recipe's ``algorithm`` section (estimator, loss, dynamic sampling);
- :mod:`~megatron_gigpo.algo.advantages`: estimator registry (``gigpo``, ``grpo``, ``rloo``) and GiGPO parts;
- :mod:`~megatron_gigpo.algo.returns`: discounted step returns, episode returns;
- :mod:`~megatron_gigpo.algo.grouping`: anchor-state grouping (exact and similarity);
- :mod:`~megatron_gigpo.algo.group_stats`: float64 group statistics;
- :mod:`~megatron_gigpo.algo.scatter`: row advantage -> tokens (torch reference, Triton kernel on CUDA);
- :mod:`~megatron_gigpo.algo.losses`: PPO clipped loss with dual clip, KL penalties, entropy, aggregation;
- :mod:`~megatron_gigpo.algo.oracle`: slow loop-based reference, for tests and benchmarks only.
"""
