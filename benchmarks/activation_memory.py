"""Activation memory of one update, estimated and measured: the check of the ``activ`` column of
``megatron-gigpo validate --plan`` (:func:`megatron_gigpo.cluster.activations.activation_bytes`, the function the plan
calls).

For two sizes of a random Qwen2-shaped model (hidden 256 and 512, 4 layers, grouped-query attention, SwiGLU) the
script builds the Megatron policy actor (``PolicyActor``, one process, CPU, float32: Megatron's local layer spec)
and runs one update whose rows form one micro-batch, once per recompute setting (none, selective, full uniform
1, full block 2). It measures the bytes autograd keeps for backward: every tensor saved for backward passes through
``torch.autograd.graph.saved_tensors_hooks``; the script sums the distinct storages that are alive (parameters
excluded), over the forward and the backward (recomputation included), and reports the peak. That is the
activation memory by definition, free of allocator caching and other noise an RSS reading has. Prints the
estimate, the measurement and the relative error per size and setting.

    python benchmarks/activation_memory.py [--rows 8] [--prompt-len 384] [--response-len 128] [--sizes dense,moe]

``--sizes moe`` measures a small Qwen3-MoE instead (:data:`MOE_SIZES`; the estimate's MoE term assumes balanced
routing, a random router is near it).

What the measurement leaves out as the estimate does: the output layer's chunks (recomputed inside
``torch.utils.checkpoint``, whose own hooks keep them from ours; the plan's ``lp-chunk`` column) and the optimizer.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import weakref
from pathlib import Path

import torch

SIZES = {  # hidden, heads, KV heads, FFN
    "hidden 256": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=704),
    "hidden 512": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1408),
}
#: ``--sizes moe``: a Qwen3-MoE (8 experts of FFN 352, top-2: the experts' active FFN equals hidden 256's 704; Qwen3's
#: q/k norms) on the CPU's path, SequentialMLP behind the all-gather dispatcher (EP1)
MOE_SIZES = {
    "moe 256": dict(model_type="qwen3_moe", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    intermediate_size=704, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=352,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
}
COMMON = dict(num_hidden_layers=4, vocab_size=4096, max_position_embeddings=4096, tie_word_embeddings=False)
SETTINGS = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full uniform 1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full block 2": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
}


class SavedTensorMeter:
    """Live bytes of the distinct storages autograd holds for backward, and their peak (parameters excluded).

    Use as a context manager around forward and backward; each saved tensor is counted once per storage (views
    of one tensor share it) from when it is saved until autograd releases its last saved reference."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude, self.live, self.refs, self.peak = exclude, 0, {}, 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return t
        packed = t.detach()  # the same storage, no reference back to the graph
        if key not in self.refs:
            self.refs[key] = 0
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(packed, self._release, key, storage.nbytes())
        return packed

    def _release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= nbytes

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _batch(rows: int, prompt_len: int, response_len: int, vocab: int):
    from megatron_gigpo.episodes.batch import TrainingBatch

    g = torch.Generator().manual_seed(0)
    # lengths vary by +-25% as in real batches: the micro-batch is padded to its longest row
    prompts = [torch.randint(0, vocab, (int(prompt_len * (0.75 + 0.5 * i / rows)),), generator=g) for i in range(rows)]
    responses = [torch.randint(0, vocab, (int(response_len * (1.25 - 0.5 * i / rows)),), generator=g)
                 for i in range(rows)]
    return TrainingBatch(prompt_ids=prompts, response_ids=responses,
                         rollout_log_probs=[torch.zeros(r.numel()) for r in responses],
                         uid=[str(i) for i in range(rows)],
                         traj_id=[str(i) for i in range(rows)], step_index=torch.zeros(rows, dtype=torch.int64),
                         anchor=["s"] * rows, env_reward=torch.zeros(rows, dtype=torch.float64),
                         action_valid=torch.ones(rows, dtype=torch.bool))


def _measure(model_dir: Path, batch, settings: dict) -> int:
    """Peak saved-activation bytes of one on-policy update of ``batch`` as one micro-batch."""
    from megatron_gigpo.actor import distributed
    from megatron_gigpo.actor.config import ActorConfig
    from megatron_gigpo.actor.policy import PolicyActor

    tokens = len(batch.prompt_ids) * max(p.numel() + r.numel() for p, r in zip(batch.prompt_ids, batch.response_ids))
    config = ActorConfig.build(model_dir, micro_batch_tokens=tokens, ppo_mini_batch_size=len(batch.prompt_ids),
                               use_kl_loss=False, entropy_coeff=0.0, shuffle=False, **settings)
    actor = PolicyActor(config)
    params = {p.untyped_storage().data_ptr() for chunk in actor.model_chunks for p in chunk.parameters()}
    with SavedTensorMeter(params) as meter:
        actor.update(batch, torch.linspace(-1, 1, len(batch.prompt_ids)), None)
    del actor
    distributed.destroy(process_group=False)
    return meter.peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=384)
    parser.add_argument("--response-len", type=int, default=128)
    parser.add_argument("--sizes", default="dense", help="dense (hidden 256 and 512), moe, or dense,moe")
    args = parser.parse_args(argv)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

    from megatron_gigpo.actor.config import RecomputeConfig
    from megatron_gigpo.cluster.activations import activation_bytes

    dist.init_process_group("gloo")
    batch = _batch(args.rows, args.prompt_len, args.response_len, COMMON["vocab_size"])
    longest = max(p.numel() + r.numel() for p, r in zip(batch.prompt_ids, batch.response_ids))
    tokens = args.rows * longest
    print(f"one micro-batch of {args.rows} rows padded to {longest} tokens = {tokens} tokens; float32, CPU, "
          f"Megatron's local layer spec; MiB")
    print(f"{'model':<11} {'recompute':<15} {'estimate':>9} {'measured':>9} {'error':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        chosen = args.sizes.split(",")
        sizes = {**(SIZES if "dense" in chosen else {}), **(MOE_SIZES if "moe" in chosen else {})}
        for size, shape in sizes.items():
            hf = shape | COMMON
            model_dir = Path(tmp) / size.replace(" ", "-")
            torch.manual_seed(0)
            shape_kw = {k: v for k, v in hf.items() if k != "model_type"}
            config = Qwen3MoeConfig(**shape_kw) if size in MOE_SIZES else Qwen2Config(**shape_kw)
            AutoModelForCausalLM.from_config(config).save_pretrained(str(model_dir))
            for name, settings in SETTINGS.items():
                measured = _measure(model_dir, batch, settings)
                estimate = activation_bytes(hf, tokens=tokens, row_tokens=longest, element_bytes=4,
                                            recompute=RecomputeConfig(**settings)).total
                print(f"{size:<11} {name:<15} {estimate / 2**20:9.2f} {measured / 2**20:9.2f} "
                      f"{(estimate - measured) / measured:+7.2%}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
