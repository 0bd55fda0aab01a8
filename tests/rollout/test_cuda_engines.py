"""The GPU backends' wiring, checked on CPU (megatron_gigpo.rollout.transfer.cuda_engines): vLLM's factories resolve
``mgigpo_ipc`` / ``mgigpo_nccl`` to our classes, the staging mixin owns the update lifecycle (vLLM's per-chunk
layerwise load is never entered), and the trainer-side init infos are vLLM's, packed, with one NCCL rank range per
engine. The transports themselves run in tests/rollout/test_gpu_sync.py (gpu)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def cuda_engines():
    from megatron_gigpo.rollout import vllm_plugin
    from megatron_gigpo.rollout.transfer import cuda_engines

    vllm_plugin.register()
    return cuda_engines


def test_vllm_creates_our_staged_engines_for_the_gpu_backend_names(cuda_engines):
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from megatron_gigpo.rollout.transfer.staged import StagedWeightTransfer
    from megatron_gigpo.rollout.vllm_plugin import IPC_BACKEND, NCCL_BACKEND

    for name, ours, transport in ((IPC_BACKEND, cuda_engines.StagedIPCWeightTransferEngine, IPCWeightTransferEngine),
                                  (NCCL_BACKEND, cuda_engines.StagedNCCLWeightTransferEngine,
                                   NCCLWeightTransferEngine)):
        assert WeightTransferEngineFactory._registry[name]() is ours
        mro = ours.__mro__
        assert mro.index(StagedWeightTransfer) < mro.index(transport)
        # the staging owns the lifecycle: vLLM's initialize/finalize_layerwise_reload (a load per chunk) never runs
        for method in ("start_weight_update", "update_weights"):
            assert getattr(ours, method) is getattr(StagedWeightTransfer, method), (name, method)
        assert ours.receive_weights is not transport.receive_weights
        assert ours.finish_weight_update is not transport.finish_weight_update
        assert ours.init_info_cls is transport.init_info_cls
    # the trainer sides are vLLM's own ipc / nccl, dispatched on the init info's backend
    plan = _plan((2, 1), IPC_BACKEND)
    ipc = cuda_engines.ipc_trainer_init_info(plan, 1)
    nccl = cuda_engines.nccl_trainer_init_info(plan, 0, master_address="10.0.0.1", master_port=29555)
    assert (type(ipc).backend, ipc.rank, ipc.is_sender, ipc.packed) == ("ipc", 1, False, True)
    assert (type(nccl).backend, nccl.is_sender, nccl.packed, nccl.world_size) == ("nccl", True, True, 4)
    for info in (ipc, nccl):
        assert type(info).backend in WeightTransferTrainerFactory._registry
        # the embedding (64 x 32 fp32 = 8 KiB) is larger than the bucket: vLLM's ipc producer refuses a tensor
        # larger than its buffer, so the buffer grows to it
        assert info.packed_buffer_size_bytes == 64 * 32 * 4


def test_ipc_chunks_may_carry_the_trainers_digests(cuda_engines):
    info = cuda_engines.StagedIPCUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[2]], ipc_handles={},
                                            tensor_sizes=[8], digests=["ab" * 32])
    assert info.digests == ["ab" * 32]
    plain = cuda_engines.StagedIPCWeightTransferEngine.update_info_cls(
        names=["a"], dtype_names=["float32"], shapes=[[2]], ipc_handles={}, tensor_sizes=[8])
    assert plain.digests is None
    with pytest.raises(ValueError, match="`shapes` should be of the same size"):  # vLLM's own check still runs
        cuda_engines.StagedIPCUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[], ipc_handles={})


def test_every_engine_gets_its_own_nccl_rank_range(cuda_engines):
    """vLLM's nccl trainer sends one worker init info with rank_offset=1 to every engine; engines count their
    workers' ranks from 0, so two engines would both claim rank 1. The client hands each its own offset."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    from megatron_gigpo.rollout.transfer.client import EngineGroupClient
    from megatron_gigpo.rollout.vllm_plugin import NCCL_BACKEND

    workers = (2, 1, 3)
    trainer = cuda_engines.nccl_trainer_init_info(_plan(workers, NCCL_BACKEND), 0, master_address="10.0.0.1",
                                                  master_port=29555)
    # what vLLM's NCCLTrainerWeightTransferEngine.trainer_init sends to the client
    payload = worker_init_payload(NCCLWeightTransferInitInfo(
        master_address=trainer.master_address, master_port=trainer.master_port, rank_offset=1,
        world_size=trainer.world_size, packed=trainer.packed, packed_buffer_size_bytes=trainer.packed_buffer_size_bytes,
        packed_num_buffers=trainer.packed_num_buffers))
    client = EngineGroupClient(["e0", "e1", "e2"], workers, timeout_s=1.0)
    infos = client.per_engine_init_info(payload)
    ranks = [NCCLWeightTransferInitInfo(**info).rank_offset + r  # vLLM's worker rank: offset + its TP rank
             for info, n in zip(infos, workers) for r in range(n)]
    assert ranks == list(range(1, trainer.world_size))  # rank 0 is the trainer
    assert all(info["world_size"] == 7 and info["master_port"] == 29555 and info["packed"] for info in infos)


def _plan(workers, backend):
    from megatron_gigpo.rollout.weight_sync import SyncPlan, WeightSpec

    spec = WeightSpec(shapes={"model.embed_tokens.weight": (64, 32), "model.norm.weight": (32,)},
                      optional={"lm_head.weight": (64, 32)}, dtype="float32")
    return SyncPlan(engines=tuple(f"e{k}" for k in range(len(workers))), engine_workers=tuple(workers),
                    engine_nodes=("n0",) * len(workers), version=1, bucket_size_bytes=1 << 10, spec=spec,
                    backend=backend)
