"""Constants and helpers shared by the rollout tests (imported by module name; the folder is on sys.path)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from megatron_gigpo.config import RolloutConfig

# Engine actors: quiet vLLM; small fixed settings so engines and Megatron ranks fit beside other tests.
# 128 + 128 = 256 tokens of context, 1 GiB of KV cache per engine; all of vLLM in the engine actor's process, as
# the placement plan runs a CPU engine of TP 1.
ROLLOUT = RolloutConfig(prompt_length=128, response_length=128, cpu_kvcache_space_gib=1.0)
ENGINE_KWARGS = dict(
    rollout=ROLLOUT,
    max_num_seqs=16,
    seed=0,
    env_vars={"VLLM_LOGGING_LEVEL": "WARNING"},
    distributed_executor_backend="uni",
)


@contextlib.contextmanager
def launched_engine(ray_session, config) -> Iterator[Any]:
    """A started ``RolloutEngine`` actor of ``config`` (an ``EngineConfig``), shut down and killed on exit."""
    from megatron_gigpo.rollout.engine import RolloutEngine

    handle = RolloutEngine.launch(config)
    try:
        ray_session.get(handle.ready.remote())
        yield handle
    finally:
        ray_session.get(handle.shutdown.remote())
        ray_session.kill(handle)


def random_prompts(n: int, seed: int = 0, vocab: int = 500) -> list[list[int]]:
    """``n`` prompts of 3..11 random token ids."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def hf_log_probs(model_dir, weights: dict[str, torch.Tensor] | None, sequences: list[list[int]],
                 dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """transformers' log p(token_t | tokens_<t), t >= 1, per sequence (float32 result; the model runs in
    ``dtype``), optionally with other weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    if weights is not None:
        model.load_state_dict(weights, strict=False)
        model.tie_weights()
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1]  # (T-1, V)
            out.append(logp.gather(-1, ids[0, 1:, None]).squeeze(-1))
    return out


def shm_chunk(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.float32, node_key: str = "local"):
    """An ``mgigpo_shm`` bucket chunk of ``named`` (packed as ``dtype`` into a new shared-memory file) and the file
    (keep it open until the update has finished, then ``close()`` it): ``({"paths", "layout", "digests"}, file)``."""
    from megatron_gigpo.rollout.checksum import tensor_digest
    from megatron_gigpo.rollout.transport import SharedMemoryBucket, pack_bucket, plan_layout, unpack_bucket

    shm = SharedMemoryBucket.create(plan_layout(named, dtype).nbytes)
    flat, layout = pack_bucket(named, dtype, out=shm.buffer)
    digests = [tensor_digest(name, view).hex() for name, view in unpack_bucket(flat, layout)]
    return {"paths": {node_key: shm.path}, "layout": layout.to_wire(), "digests": digests}, shm
