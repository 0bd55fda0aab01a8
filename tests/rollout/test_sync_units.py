"""Pure parts of the weight sync: checksum, bucket layout and packing, shared-memory files, the weight spec,
sampling settings, and the gloo broadcast group between two processes."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import save_file

from megatron_gigpo.rollout.checksum import combine_digests, tensor_digest, weights_checksum
from megatron_gigpo.rollout.engine import SamplingConfig
from megatron_gigpo.rollout.transport import (
    ALIGN_BYTES,
    BucketLayout,
    SharedMemoryBucket,
    SharedMemoryPool,
    broadcast_group,
    open_shared_memory_bucket,
    pack_bucket,
    unpack_bucket,
)
from megatron_gigpo.rollout.spec import read_checkpoint_spec
from megatron_gigpo.rollout.weight_sync import WeightSyncError
from multiproc import free_port, spawn


def _weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(8, generator=g)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(8, 12, generator=g)),
    ]


@pytest.mark.unit
def test_checksum_is_order_and_bucket_free_and_exact():
    weights = _weights()
    reference = weights_checksum(weights)
    assert weights_checksum(list(reversed(weights))) == reference
    # Per-tensor digests combined from two "buckets" give the same checksum.
    digests = {n: tensor_digest(n, t) for n, t in weights[:1]} | {n: tensor_digest(n, t) for n, t in weights[1:]}
    assert combine_digests(digests) == reference
    # One ulp in one element, two swapped elements, a renamed tensor, another dtype: all differ.
    bumped = [(n, t.clone()) for n, t in weights]
    bumped[2][1].view(-1)[5] = torch.nextafter(bumped[2][1].view(-1)[5], torch.tensor(1e9))
    swapped = [(n, t.clone()) for n, t in weights]
    flat = swapped[0][1].view(-1)
    flat[[0, 1]] = flat[[1, 0]]
    renamed = [("model.embed_tokens.weight2", weights[0][1])] + weights[1:]
    variants = [bumped, swapped, renamed]
    assert all(weights_checksum(v) != reference for v in variants)
    assert weights_checksum(weights, torch.bfloat16) != reference
    assert weights_checksum(weights, torch.bfloat16) == weights_checksum([(n, t.bfloat16()) for n, t in weights])
    with pytest.raises(ValueError, match="occurs twice"):
        weights_checksum(weights + weights[:1])


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_unpack_round_trip_with_aligned_offsets(dtype):
    weights = _weights(1)
    flat, layout = pack_bucket(weights, dtype)
    assert flat.dtype == torch.uint8 and flat.numel() == layout.nbytes
    assert all(off % ALIGN_BYTES == 0 for off in layout.offsets)
    wire = layout.to_wire()
    back = unpack_bucket(flat, BucketLayout.from_wire(wire))
    for (name, src), (got_name, got) in zip(weights, back, strict=True):
        assert got_name == name and got.dtype == dtype
        assert torch.equal(got, src.to(dtype))


@pytest.mark.unit
def test_layout_rejects_inconsistent_wire():
    _, layout = pack_bucket(_weights(), torch.float32)
    wire = layout.to_wire()
    with pytest.raises(ValueError, match="does not fit"):
        BucketLayout.from_wire({**wire, "nbytes": 64})
    with pytest.raises(ValueError, match="names"):
        BucketLayout.from_wire({**wire, "names": wire["names"][:1]})
    with pytest.raises(ValueError, match="unsupported transfer dtype"):
        BucketLayout.from_wire({**wire, "dtype": "int8"})


def _open_in_child(path: str, nbytes: int, layout_wire: dict) -> list[float]:
    layout = BucketLayout.from_wire(layout_wire)
    return [float(t.sum()) for _, t in unpack_bucket(open_shared_memory_bucket(path, nbytes), layout)]


@pytest.mark.unit
def test_shared_memory_bucket_is_readable_by_another_process_and_outlives_close():
    import multiprocessing as mp

    weights = _weights(2)
    _, layout = pack_bucket(weights, torch.float32)
    shm = SharedMemoryBucket.create(layout.nbytes)
    pack_bucket(weights, torch.float32, out=shm.buffer)
    with mp.get_context("spawn").Pool(1) as pool:
        sums = pool.apply(_open_in_child, (shm.path, layout.nbytes, layout.to_wire()))
    assert sums == [float(t.sum()) for _, t in weights]
    mapped = open_shared_memory_bucket(shm.path, layout.nbytes)
    path = shm.path
    shm.close()
    for (_, src), (_, got) in zip(weights, unpack_bucket(mapped, layout), strict=True):
        assert torch.equal(got, src)  # a receiver's mapping survives the sender's close
    with pytest.raises(FileNotFoundError):
        open_shared_memory_bucket(path, layout.nbytes)


@pytest.mark.unit
def test_shared_memory_pool_reuses_files_only_after_release():
    pool = SharedMemoryPool()
    first, second = pool.acquire(1000), pool.acquire(500)
    assert first.path != second.path  # busy files are never handed out twice in one sync
    pool.release_all()
    again = pool.acquire(400)
    assert again is second  # best fit among the free files
    bigger = pool.acquire(2000)
    assert bigger is not first and bigger.buffer.numel() == 2000
    pool.close()
    assert first.fd == second.fd == bigger.fd == -1


@pytest.mark.unit
def test_weight_spec_from_checkpoint_headers(tmp_path):
    weights = dict(_weights())
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true}')
    spec = read_checkpoint_spec(tmp_path, "bfloat16")
    assert spec.shapes == {n: tuple(t.shape) for n, t in weights.items()}
    assert spec.optional == {"lm_head.weight": (16, 8)}
    seen: set[str] = set()
    spec.check_tensor("model.embed_tokens.weight", (16, 8), seen)
    spec.check_tensor("lm_head.weight", (16, 8), seen)  # tied: optional
    with pytest.raises(WeightSyncError, match="sent twice"):
        spec.check_tensor("model.embed_tokens.weight", (16, 8), seen)
    with pytest.raises(WeightSyncError, match=r"has shape \(8, 8\), the engine expects \(8, 12\)"):
        spec.check_tensor("model.layers.0.mlp.down_proj.weight", (8, 8), seen)
    with pytest.raises(WeightSyncError, match="'model.layers.0.mlp.up_proj.weight' is not a weight"):
        spec.check_tensor("model.layers.0.mlp.up_proj.weight", (8, 12), seen)
    with pytest.raises(WeightSyncError, match="2 of 3 weights were not sent"):
        spec.check_complete(seen)
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_checkpoint_spec(tmp_path / "nowhere", "float32")


@pytest.mark.unit
def test_sampling_config_validation_and_seeds():
    config = SamplingConfig(temperature=0.7, top_p=0.9, top_k=-1, max_tokens=5, stop=["</a>"], seed=10)
    params = config.to_vllm(3)
    assert params.seed == 13 and params.top_k == 0 and params.logprobs == 0 and params.stop == ["</a>"]
    assert SamplingConfig(seed=None).to_vllm(3).seed is None
    assert SamplingConfig.greedy(4).temperature == 0.0
    for bad in [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_tokens=0), dict(stop="</a>")]:
        with pytest.raises(ValueError, match="SamplingConfig"):
            SamplingConfig(**bad)


def _broadcast_member(rank: int, world_size: int, port: int) -> list[float]:
    group = broadcast_group("127.0.0.1", port, rank, world_size, "gloo", timeout_s=60)
    weights = _weights(3)
    _, layout = pack_bucket(weights, torch.float32)
    flat = pack_bucket(weights, torch.float32)[0] if rank == 0 else torch.zeros(layout.nbytes, dtype=torch.uint8)
    group.broadcast(flat)
    return [float(t.sum()) for _, t in unpack_bucket(flat, layout)]


@pytest.mark.multiprocess
def test_gloo_broadcast_group_without_default_process_group():
    results = spawn(_broadcast_member, 3, free_port(), timeout=120)
    assert results[1] == results[0] and results[2] == results[0]


def test_each_engine_node_is_written_by_its_lowest_actor_rank():
    from megatron_gigpo.rollout.errors import WeightSyncError
    from megatron_gigpo.rollout.transfer.cpu_trainers import node_writers

    assert node_writers(["a", "a", "b", "b"], ["b", "a", "b"]) == {"b": 2, "a": 0}
    with pytest.raises(WeightSyncError, match="engine 1 on node c has no actor rank there: mgigpo_shm needs one"):
        node_writers(["a", "b"], ["a", "c"])


def test_engine_group_client_gives_each_engine_its_own_rank_offset():
    from megatron_gigpo.rollout.transfer.client import EngineGroupClient

    client = EngineGroupClient(["e0", "e1", "e2"], [2, 1, 2], timeout_s=1.0)
    infos = client.per_engine_init_info({"rank_offset": 1, "world_size": 6})
    assert [(i["rank_offset"], i["world_size"]) for i in infos] == [(1, 6), (3, 6), (4, 6)]
    assert client.per_engine_init_info({"dtype": "float32"}) == [{"dtype": "float32"}] * 3
    with pytest.raises(ValueError, match="2 init infos for 3 engines"):
        client.per_engine_init_info([{}, {}])


@pytest.mark.unit
def test_export_source_per_backend_metadata_and_every_rank_yielding():
    """mgigpo_nccl: ``metadata()`` from export_metadata's tuples; mgigpo_ipc: non-senders yield their (full)
    buckets unchecked while the sender still checks and hashes; other backends: non-senders yield nothing."""
    from vllm.distributed.weight_transfer.base import ParamMeta

    from megatron_gigpo.rollout.transfer.source import MegatronExportSource
    from megatron_gigpo.rollout.vllm_plugin import IPC_BACKEND, NCCL_BACKEND, SHM_BACKEND
    from megatron_gigpo.rollout.weight_sync import SyncPlan, WeightSpec

    weights = _weights()
    spec = WeightSpec(shapes={n: tuple(t.shape) for n, t in weights}, optional={}, dtype="float32")
    plans = {b: SyncPlan((), (), (), 1, 1, spec, backend=b) for b in (SHM_BACKEND, IPC_BACKEND, NCCL_BACKEND)}
    assert [(p.export_destination, p.needs_metadata) for p in plans.values()] == [
        ("rank0", False), ("all", False), ("rank0", True)]
    meta = [(n, t.dtype, tuple(t.shape)) for n, t in weights]
    source = MegatronExportSource([weights[:2], weights[2:]], spec, is_sender=False, metadata=meta)
    assert source.metadata() == [ParamMeta(*m) for m in meta] and list(source) == []
    with pytest.raises(NotImplementedError, match="metadata="):
        MegatronExportSource([], spec, is_sender=True).metadata()
    others = MegatronExportSource([weights[:2], weights[2:]], spec, is_sender=False, yield_all=True)
    assert [n for n, _ in others] == [n for n, _ in weights] and not others.digests
    sender = MegatronExportSource([weights[:2], weights[2:]], spec, is_sender=True, yield_all=True)
    assert [n for n, _ in sender] == [n for n, _ in weights]
    assert sender.checksum() == weights_checksum(weights, torch.float32)
