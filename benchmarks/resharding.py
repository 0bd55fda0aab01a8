"""Weight resharding into a vLLM engine, and rollout throughput through the engine actor.

Part 1, sync time (target: <= 3x a plain copy of the same bytes). For each model, Megatron ranks run as Ray
actors (gloo), a ``RolloutEngine`` actor serves the model, and ``weight_sync.sync_weights`` pushes the
actor's weights through vLLM's weight-transfer protocol with the colocated CPU backend ``mgigpo_shm`` (export +
cast + pack + hash + transport + staging + commit checksum + in-place load + prefix-cache reset). In the same run
and alternating with it, the old path (main's ``shm`` sync before #39, kept in ``benchmarks/_old_sync.py`` only:
same export, packing and hashing, its own engine-side staging through a worker extension of a second, bare vLLM
engine) pushes the same weights, and one warm ``torch`` copy of the same number of bytes is timed.

- SmolLM2-135M-Instruct (``builtin:smollm2-135m-instruct``, Llama, 9 heads: TP2 impossible) from a PP2 actor.
- A Qwen2-shaped model of similar size (random weights, 640 hidden, 10 heads / 2 KV heads, 24 layers,
  SmolLM2's 49,152-token vocabulary, tied) from a TP2 actor.

Part 2, rollout throughput (target: >= 80% of vLLM called directly). The same prompts and sampling
settings through ``RolloutEngine.generate`` (a Ray actor call) and through ``vllm.LLM.generate`` in this
process; both are started and warmed up, then measured alternately (median of ``--repeats`` rounds).

Run from the repository root (about 10 minutes on 2 cores)::

    python benchmarks/resharding.py                  # both parts, bf16 engines
    python benchmarks/resharding.py --part sync --dtype float32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from megatron_gigpo.deadlines import get_with_deadline

QWEN2_SHAPE = dict(hidden_size=640, intermediate_size=1792, num_hidden_layers=24, num_attention_heads=10,
                   num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)


def _rollout():
    """The engines' recipe section: 256 + 256 = 512 tokens of context, 1 GiB of KV cache."""
    from megatron_gigpo.config import RolloutConfig

    return RolloutConfig(prompt_length=256, response_length=256, cpu_kvcache_space_gib=1.0)


class BenchRank:
    """One Megatron rank (a Ray actor; pickled by value from this script)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    @staticmethod
    def address() -> tuple[str, int]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return "127.0.0.1", sock.getsockname()[1]

    def init(self, addr: str, port: int, model_dir: str, tp: int, pp: int) -> int:
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=addr, MASTER_PORT=str(port))
        from megatron_gigpo.actor import distributed
        from megatron_gigpo.models.builder import build_gpt_model, load_hf_config
        from megatron_gigpo.models.weights import load_hf_weights

        distributed.initialize(tp, pp, seed=1)
        self.model = build_gpt_model(load_hf_config(model_dir))
        load_hf_weights(self.model, model_dir)
        return sum(p.numel() for p in self.model.parameters())

    def push_weights(self, plan):
        from megatron_gigpo.models.weights import export_hf_weights, export_metadata
        from megatron_gigpo.rollout.weight_sync import push_weights

        metadata = export_metadata(self.model, dtype=plan.export_dtype) if plan.needs_metadata else None
        buckets = export_hf_weights(self.model, bucket_size_bytes=plan.bucket_size_bytes,
                                    dtype=plan.export_dtype, destination=plan.export_destination)
        return push_weights(buckets, plan, metadata=metadata)

    def old_push(self, engine, version: int, dtype: str, bucket_size_bytes: int, timeout_s: float):
        """The pre-#39 path (benchmarks/_old_sync.py); ``engine`` on rank 0 only, None elsewhere."""
        from _old_sync import old_push

        from megatron_gigpo.models.weights import export_hf_weights
        from megatron_gigpo.rollout.transport import dtype_from_name

        buckets = export_hf_weights(self.model, bucket_size_bytes=bucket_size_bytes, dtype=dtype_from_name(dtype))
        return old_push(buckets, engine if self.rank == 0 else None, version, dtype, timeout_s)


def qwen2_shaped_model(root: Path, tokenizer_dir: Path) -> Path:
    """Write the random Qwen2-shaped model (once) with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = root / "qwen2-shaped-137m"
    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = Qwen2Config(**QWEN2_SHAPE, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".qwen2."))
    Qwen2ForCausalLM(config).save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, out)
    return out


def copy_seconds(nbytes: int, repeats: int = 5) -> tuple[float, float]:
    """One torch copy of ``nbytes`` bytes, single-threaded like the ranks: (into fresh memory, warm best)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        tick = time.perf_counter()
        dst.copy_(src)
        cold = time.perf_counter() - tick
        warm = float("inf")
        for _ in range(repeats):
            tick = time.perf_counter()
            dst.copy_(src)
            warm = min(warm, time.perf_counter() - tick)
        return cold, warm
    finally:
        torch.set_num_threads(threads)


def bench_sync(name: str, model_dir: Path, tp: int, pp: int, args) -> dict[str, Any]:
    import ray

    from _old_sync import OldEngine

    from megatron_gigpo.rollout.engine import EngineConfig, RolloutEngine
    from megatron_gigpo.rollout.weight_sync import sync_weights

    world = tp * pp
    ranks = [ray.remote(BenchRank).options(num_cpus=0.5).remote(r, world) for r in range(world)]
    rollout = _rollout()
    engine = RolloutEngine.launch(EngineConfig(model_path=str(model_dir), dtype=args.dtype, rollout=rollout,
                                               distributed_executor_backend="uni", weight_transfer_backend="mgigpo_shm",
                                               env_vars={"VLLM_LOGGING_LEVEL": "WARNING"}))
    old_engine = ray.remote(OldEngine).options(num_cpus=0.5, runtime_env={"env_vars": {"VLLM_LOGGING_LEVEL": "WARNING"}}
                                               ).remote(str(model_dir), args.dtype, int(rollout.cpu_kvcache_space_gib * (1 << 30)))
    try:
        addr, port = get_with_deadline(ranks[0].address.remote(), args.timeout_s, "BenchRank.address")
        params = get_with_deadline([r.init.remote(addr, port, str(model_dir), tp, pp) for r in ranks], args.timeout_s,
                                   "BenchRank.init on the ranks")
        get_with_deadline([engine.ready.remote(), old_engine.ready.remote()], args.timeout_s, "engines ready")
        rows, old_rows = [], []
        for version in range(1, args.repeats + 2):  # the first round warms up (Ray, shm files, allocator)
            tick = time.perf_counter()
            metrics = sync_weights(ranks, [engine], version=version, bucket_size_bytes=args.bucket_mb << 20,
                                   timeout_s=args.timeout_s)
            metrics["wall_s"] = time.perf_counter() - tick
            tick = time.perf_counter()
            old = get_with_deadline([r.old_push.remote(old_engine, version, args.dtype, args.bucket_mb << 20,
                                                       args.timeout_s) for r in ranks], args.timeout_s, "old push")[0]
            old["wall_s"] = time.perf_counter() - tick
            if version > 1:
                rows.append(metrics)
                old_rows.append(old)
        nbytes = int(rows[0]["weight_sync/bytes"])
        cold, warm = copy_seconds(nbytes)
        wall = statistics.median(r["wall_s"] for r in rows)
        old_wall = statistics.median(r["wall_s"] for r in old_rows)
        parts = {k.removeprefix("weight_sync/"): statistics.median(r[k] for r in rows)
                 for k in rows[0] if k.endswith("_s") and k.startswith("weight_sync/") and "per_s" not in k}
        old_parts = {k: statistics.median(r[k] for r in old_rows) for k in old_rows[0] if k != "wall_s"}
        return {"model": name, "layout": f"TP{tp} PP{pp}", "params": sum(params) // tp, "bytes": nbytes,
                "sync_s": wall, "old_sync_s": old_wall, "copy_cold_s": cold, "copy_warm_s": warm,
                "ratio_warm": wall / warm, "old_ratio_warm": old_wall / warm, "parts": parts, "old_parts": old_parts}
    finally:
        for actor in (engine, old_engine):
            get_with_deadline(actor.shutdown.remote(), args.timeout_s, "engine shutdown")
        for actor in ranks + [engine, old_engine]:
            ray.kill(actor)


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def bench_throughput(model_dir: Path, args) -> dict[str, Any]:
    """Tokens/s through the engine actor and through vllm.LLM directly (same prompts, seeds)."""
    import ray

    from megatron_gigpo.rollout.engine import EngineConfig, RolloutEngine, SamplingConfig

    config = EngineConfig(model_path=str(model_dir), dtype=args.dtype, rollout=_rollout(),
                          env_vars={"VLLM_LOGGING_LEVEL": "WARNING"})
    prompts = _prompts(args.num_prompts, 64, 49152)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, seed=0)
    warm = prompts[:4]
    from vllm import LLM

    engine = RolloutEngine.launch(config)
    llm = None
    try:
        get_with_deadline(engine.ready.remote(), args.timeout_s, "RolloutEngine.ready")
        llm = LLM(model=str(model_dir), dtype=args.dtype, max_model_len=512, seed=0, enforce_eager=True,
                  enable_prefix_caching=True, kv_cache_memory_bytes=1 << 30)

        def direct(batch):
            params = [sampling.to_vllm(i) for i in range(len(batch))]
            outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outputs)

        def through_actor(batch):
            results = get_with_deadline(engine.generate.remote(batch, sampling), args.timeout_s, "RolloutEngine.generate")
            return sum(len(r.response_ids) for r in results)

        through_actor(warm)
        direct(warm)
        runs = {"actor": [], "direct": []}
        for _ in range(args.repeats):  # alternate, so both see the same background load
            for kind, fn in (("actor", through_actor), ("direct", direct)):
                tick = time.perf_counter()
                tokens = fn(prompts)
                runs[kind].append((tokens, time.perf_counter() - tick))
    finally:
        get_with_deadline(engine.shutdown.remote(), args.timeout_s, "RolloutEngine.shutdown")
        ray.kill(engine)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
    actor_tokens, direct_tokens = runs["actor"][0][0], runs["direct"][0][0]
    actor_tps = statistics.median(t / s for t, s in runs["actor"])
    direct_tps = statistics.median(t / s for t, s in runs["direct"])
    return {"prompts": len(prompts), "actor_tokens": actor_tokens, "direct_tokens": direct_tokens,
            "actor_tok_s": actor_tps, "direct_tok_s": direct_tps, "ratio": actor_tps / direct_tps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "sync", "throughput"), default="all")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measured syncs per model (after one warm-up) and throughput rounds")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="deadline of every wait on a rank or the engine (start, sync, generate)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    import ray

    from megatron_gigpo.models.builtin import cache_root, resolve_model_path
    from megatron_gigpo.cluster.ray_setup import local_ray_env

    smollm2 = resolve_model_path("builtin:smollm2-135m-instruct")
    root = cache_root() / "models"
    qwen2 = qwen2_shaped_model(root, smollm2)
    out: dict[str, Any] = {"dtype": args.dtype, "bucket_mb": args.bucket_mb}
    with local_ray_env() as env:  # token auth with this run's own token, removed afterwards
        # benchmarks/ on every actor's path: the old path's module (its vLLM worker extension is imported by name)
        path = os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path, **env}})
        try:
            if args.part in ("all", "sync"):
                out["sync"] = [bench_sync("SmolLM2-135M", smollm2, 1, 2, args),
                               bench_sync("Qwen2-shaped-137M", qwen2, 2, 1, args)]
                print(f"\nweight sync ({args.dtype} transfer, {args.bucket_mb} MiB buckets, median of {args.repeats}; "
                      "new = vLLM protocol + mgigpo_shm, old = main's shm path):")
                print(f"{'model':<20}{'actor':<9}{'MB':>6}{'new s':>8}{'old s':>8}{'warm copy s':>13}"
                      f"{'new/copy':>10}{'old/copy':>10}   breakdown new | old (s)")
                for row in out["sync"]:
                    parts = " ".join(f"{k.removesuffix('_s')}={v:.2f}" for k, v in row["parts"].items()
                                     if k not in ("total_s", "gb_per_s"))
                    old_parts = " ".join(f"{k.removesuffix('_s')}={v:.2f}" for k, v in row["old_parts"].items()
                                         if k != "total_s")
                    print(f"{row['model']:<20}{row['layout']:<9}{row['bytes'] / 1e6:>6.0f}{row['sync_s']:>8.2f}"
                          f"{row['old_sync_s']:>8.2f}{row['copy_warm_s']:>13.3f}{row['ratio_warm']:>9.1f}x"
                          f"{row['old_ratio_warm']:>9.1f}x   {parts} | {old_parts}")
                print("target: sync <= 3x copy. export is Megatron's TP/PP gather (both paths), commit the engines' "
                      "checksum check + vLLM's in-place reload.")
            if args.part in ("all", "throughput"):
                out["throughput"] = bench_throughput(smollm2, args)
                t = out["throughput"]
                print(f"\nrollout throughput (SmolLM2-135M, {t['prompts']} prompts x {args.max_tokens} tokens):")
                print(f"engine actor {t['actor_tok_s']:.0f} tok/s, vLLM direct {t['direct_tok_s']:.0f} tok/s, "
                      f"ratio {t['ratio']:.0%} (target >= 80%)")
        finally:
            ray.shutdown()
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=2))
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
