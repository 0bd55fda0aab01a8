"""vLLM rollout engines and in-memory weight resharding from the Megatron actor.

- :mod:`~megatron_gigpo.rollout.engine`: ``RolloutEngine`` (a Ray actor hosting ``vllm.LLM``),
  ``RolloutEngineGroup`` (data parallel), ``SamplingConfig``, ``GenerationResult``.
- :mod:`~megatron_gigpo.rollout.weight_sync`: ``sync_weights`` / ``push_weights`` with version and checksum.
- :mod:`~megatron_gigpo.rollout.transport`: bucket layout, shared-memory files and the gloo broadcast group.
- :mod:`~megatron_gigpo.rollout.transfer`: our vLLM weight-transfer backends (engine and trainer sides).
- :mod:`~megatron_gigpo.rollout.worker_extension`: the vLLM worker side (stage, then load in place).
- :mod:`~megatron_gigpo.rollout.checksum`: the exact checksum both sides compute.

Nothing is imported here so that ``import megatron_gigpo.rollout`` stays cheap (vLLM loads on first use).
"""
