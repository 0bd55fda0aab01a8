"""Our backends of vLLM 0.32's weight-transfer protocol (``vllm.distributed.weight_transfer``).

- :mod:`.staged`: the engine-side staging every backend shares (check, digest, commit or abort, load on finish).
- :mod:`.cpu_engines`: engine sides of ``mgigpo_shm`` (shared-memory files) and ``mgigpo_gloo`` (gloo broadcast).
- :mod:`.cpu_trainers`: their trainer sides.
- :mod:`.cuda_engines`: ``mgigpo_ipc`` / ``mgigpo_nccl``, vLLM's CUDA transports with our staging.

Registered with vLLM by :func:`megatron_gigpo.rollout.vllm_plugin.register` (the backend names live there). Nothing
is imported here: vLLM imports each backend's module when it creates an engine of it.
"""
