"""vLLM rollout engines and in-memory weight resharding from the Megatron actor.

- :mod:`~megatron_gigpo.rollout.engine`: ``RolloutEngine`` (a Ray actor hosting ``vllm.LLM``, the engine end of
  vLLM's weight-transfer protocol); :mod:`~megatron_gigpo.rollout.engine_group`: ``RolloutEngineGroup`` (K engines,
  data parallel); :mod:`~megatron_gigpo.rollout.sampling`: ``SamplingConfig``, ``GenerationResult`` (re-exported
  by ``engine``).
- :mod:`~megatron_gigpo.rollout.vllm_plugin`: our vLLM weight-transfer backends' names and their registration
  (vLLM plugin entry point); :mod:`~megatron_gigpo.rollout.transfer`: the backends.
- :mod:`~megatron_gigpo.rollout.weight_sync`: ``sync_weights`` / ``push_weights`` with version and checksum.
- :mod:`~megatron_gigpo.rollout.transport`: bucket layout, shared-memory files and the gloo broadcast group.
- :mod:`~megatron_gigpo.rollout.worker_extension`: worker methods the protocol lacks (abort, backend info).
- :mod:`~megatron_gigpo.rollout.checksum`: the exact checksum both sides compute.

Nothing is imported here so that ``import megatron_gigpo.rollout`` stays cheap (vLLM loads on first use).
"""
