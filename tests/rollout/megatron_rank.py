"""A Megatron actor rank hosted as a Ray actor, for the weight-sync tests and the resharding benchmark.

Each :class:`MegatronRank` is one torch.distributed (gloo) rank: ``MASTER_ADDR``/``MASTER_PORT`` from rank 0,
``megatron_gigpo.actor.distributed.initialize(tp, pp)``, a ``GPTModel`` from ``build_gpt_model`` with HF
weights from ``load_hf_weights``. It exposes what the tests need: ``push_weights(plan)`` (the method
``weight_sync.sync_weights`` calls), full-vocabulary log-probs of fixed sequences (PP = 1 only), and one SGD
step. Imported by Ray workers by module name, so the tests put this folder on the workers' PYTHONPATH.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch


class MegatronRank:
    """One Megatron rank (wrap with ``ray.remote``)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.model = None

    @staticmethod
    def address() -> tuple[str, int]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return "127.0.0.1", sock.getsockname()[1]

    def init(self, master_addr: str, master_port: int, model_dir: str, tp: int, pp: int,
             lora: dict | None = None, ep: int = 1) -> None:
        """Join the group and build the model; ``lora``: :class:`~megatron_gigpo.models.config.LoraConfig` fields to
        freeze the model and attach LoRA adapters (then ``sgd_step`` trains only them); ``ep``: expert-parallel
        size of a mixture-of-experts model (expert TP 1)."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        torch.set_num_threads(1)
        from megatron_gigpo.actor import distributed
        from megatron_gigpo.models.builder import build_gpt_model, load_hf_config
        from megatron_gigpo.models.weights import load_hf_weights

        distributed.initialize(tp, pp, seed=1234, expert_model_parallel_size=ep,
                               expert_tensor_parallel_size=1 if ep > 1 else None)
        self.model_dir = model_dir
        self.hf_config = load_hf_config(model_dir)
        self.model = build_gpt_model(self.hf_config)
        load_hf_weights(self.model, model_dir)
        if lora is not None:
            from megatron_gigpo.actor.lora import apply_lora
            from megatron_gigpo.config import LoraConfig

            apply_lora(self.model, LoraConfig(enabled=True, **lora))

    def reload_checkpoint(self) -> None:
        """Back to the checkpoint's weights (undo the SGD steps)."""
        from megatron_gigpo.models.weights import load_hf_weights

        load_hf_weights(self.model, self.model_dir)

    def _full_log_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T-1) log p(token_t | tokens_<t) in float32, gathered over TP (PP = 1)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        batch, seq = tokens.shape
        positions = torch.arange(seq).expand(batch, seq)
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
        logits = self.model(tokens, positions, causal)  # (B, T, V_padded / TP)
        logits = gather_from_tensor_model_parallel_region(logits)[..., : self.hf_config.vocab_size]  # (B, T, V)
        logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
        return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # (B, T-1)

    def log_probs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Per-sequence log-probs of tokens 1..n-1 (sequences may differ in length)."""
        self.model.eval()
        out = []
        with torch.no_grad():
            for seq in sequences:
                out.append(self._full_log_probs(torch.tensor([seq]))[0].tolist())
        return out

    def sgd_step(self, sequences: list[list[int]], lr: float) -> float:
        """One plain SGD step on the mean negative log-likelihood of ``sequences`` (equal lengths)."""
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        loss = -self._full_log_probs(torch.tensor(sequences)).mean()
        loss.backward()
        with torch.no_grad():
            for param in self.model.parameters():
                if param.grad is not None:
                    param.add_(param.grad, alpha=-lr)
        return float(loss)

    def _export(self, bucket_size_bytes: int, dtype: torch.dtype | None = None, destination: str = "rank0"):
        from megatron_gigpo.models.weights import export_hf_weights

        return export_hf_weights(self.model, bucket_size_bytes=bucket_size_bytes, dtype=dtype, destination=destination)

    def push_weights(self, plan) -> Any:
        """What ``PolicyActor.push_weights`` does (``actor.group``): export in the engines' dtype, to the backend's
        destination, with the export's metadata where the backend needs it, and push."""
        from megatron_gigpo.models.weights import export_metadata
        from megatron_gigpo.rollout.weight_sync import push_weights

        metadata = export_metadata(self.model, dtype=plan.export_dtype) if plan.needs_metadata else None
        buckets = self._export(plan.bucket_size_bytes, plan.export_dtype, plan.export_destination)
        return push_weights(buckets, plan, metadata=metadata)

    def push_renamed(self, plan) -> Any:
        """``push_weights`` with one tensor of the third bucket renamed."""
        from megatron_gigpo.rollout.weight_sync import push_weights

        return push_weights(_corrupt(self._export(plan.bucket_size_bytes), "name"), plan)

    def push_reshaped(self, plan) -> Any:
        """``push_weights`` with one tensor of the third bucket one element short."""
        from megatron_gigpo.rollout.weight_sync import push_weights

        return push_weights(_corrupt(self._export(plan.bucket_size_bytes), "shape"), plan)

    def push_tampered_on_node_writers(self, plan) -> Any:
        """``push_weights`` where every ``mgigpo_shm`` node writer other than the sender flips one bit of each bucket
        in its node's file after receiving it: the engines of those nodes get other bytes than the trainer hashed
        (an engine failing mid-update on one node)."""
        from megatron_gigpo.rollout.transfer import cpu_trainers

        write = cpu_trainers.SharedMemoryTrainerEngine._write

        def tampered(engine, bucket, layout):
            path, flat = write(engine, bucket, layout)
            if not engine.is_sender and path is not None:
                flat[layout.offsets[0]] ^= 1
            return path, flat

        cpu_trainers.SharedMemoryTrainerEngine._write = tampered
        try:
            return self.push_weights(plan)
        finally:
            cpu_trainers.SharedMemoryTrainerEngine._write = write

    def exported_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """All HF tensors (on rank 0; None elsewhere)."""
        tensors = [pair for bucket in self._export(1 << 40) for pair in bucket]
        return tensors or None

    def run(self, fn: Callable, *args: Any) -> Any:
        return fn(self, *args)


def _corrupt(buckets, corruption: str, at_bucket: int = 2):
    """Corrupt the last tensor of the ``at_bucket``-th non-empty bucket (after earlier buckets were sent)."""
    seen, done = 0, False
    for bucket in buckets:
        if bucket and not done and seen == at_bucket:
            name, tensor = bucket[-1]
            if corruption == "name":
                bucket[-1] = ("model.bogus." + name, tensor)
            elif corruption == "shape":
                bucket[-1] = (name, tensor.reshape(-1)[:-1])
            else:
                raise ValueError(corruption)
            done = True
        seen += bool(bucket)
        yield bucket


class StateDictRank:
    """A stand-in trainer rank without Megatron: pushes an HF state dict (wrap with ``ray.remote``)."""

    def push_weights(self, plan, weights: dict[str, torch.Tensor], transport_order: list[str] | None = None) -> Any:
        from megatron_gigpo.rollout.weight_sync import push_weights

        names = transport_order or list(weights)
        buckets, current, size = [], [], 0
        for name in names:
            nbytes = weights[name].numel() * weights[name].element_size()
            if current and size + nbytes > plan.bucket_size_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append((name, weights[name]))
            size += nbytes
        buckets.append(current)
        return push_weights(iter(buckets), plan)

    def release_sender_resources(self) -> None:
        """Shut down this process's trainer engines (the next sync starts a new one, with an empty shm pool)."""
        from megatron_gigpo.rollout.weight_sync import release_sender_resources

        release_sender_resources()

    def shm_pool_files(self) -> list[str]:
        """Sorted paths of the open files in this process's ``mgigpo_shm`` bucket pools (empty without one). Reads the
        trainer engines' internals: the product has no reason to list them."""
        from megatron_gigpo.rollout import weight_sync

        pools = [t.pool for t in weight_sync._TRAINERS.values() if getattr(t, "pool", None) is not None]
        return sorted(b.path for pool in pools for b in pool._free + pool._busy)
