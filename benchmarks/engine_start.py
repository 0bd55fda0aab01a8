"""Start-up of a CPU rollout engine in a Ray actor: vLLM in the actor's process (executor ``"uni"``, the placement
plan's choice for a CPU engine of TP 1) against vLLM's engine-core and worker processes (its default).

Each mode starts one ``RolloutEngine`` actor on a tiny random Qwen2 (the tests' model), waits until it is ready,
then times three ``generate`` calls of 64 prompts x 64 tokens (the first one warms up), and stops the engine.
The modes run one after the other in one Ray session; the last line prints the ratios.

Measured on the 2-core machine (2026-12-04): start 89 s (processes) against 35-38 s (in-process), warm generate
2.5-3.6 s either way; a whole tiny ``megatron-gigpo train`` run (tests/driver/test_train_e2e.py's) 197 s
against 151 s with identical metrics.

Run from the repository root (about 3 minutes on 2 cores)::

    python benchmarks/engine_start.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

MODES = {"processes": None, "in_process": "uni"}  # distributed_executor_backend of each mode


def measure(model_dir: Path, executor: str | None, prompts: int, tokens: int) -> dict[str, float]:
    """Seconds to start one engine actor, and of each of three generate calls."""
    import ray

    from megatron_gigpo.config import RolloutConfig
    from megatron_gigpo.rollout.engine import EngineConfig, RolloutEngine, SamplingConfig

    config = EngineConfig(model_path=str(model_dir), dtype="float32", distributed_executor_backend=executor,
                          rollout=RolloutConfig(prompt_length=256, response_length=tokens), num_cpus=0.5)
    start = time.perf_counter()
    engine = RolloutEngine.launch(config)
    ray.get(engine.ready.remote(), timeout=600)
    out = {"start_s": time.perf_counter() - start}
    batch = [[1 + (i + j) % 400 for j in range(100)] for i in range(prompts)]
    for k in range(3):
        t = time.perf_counter()
        ray.get(engine.generate.remote(batch, SamplingConfig(max_tokens=tokens, seed=1)), timeout=600)
        out[f"generate{k}_s"] = time.perf_counter() - t
    ray.get(engine.shutdown.remote(), timeout=120)
    ray.kill(engine)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    if args.prompts < 1 or args.tokens < 1:
        parser.error("--prompts and --tokens must be >= 1")
    import ray

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import make_tiny_hf_model

    from megatron_gigpo.cluster.ray_setup import local_ray_env

    with tempfile.TemporaryDirectory() as tmp, local_ray_env() as env:
        model = make_tiny_hf_model(Path(tmp), "qwen2", tie=True, seed=7, hidden_size=128, intermediate_size=256)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
        try:
            results = {mode: measure(model, executor, args.prompts, args.tokens) for mode, executor in MODES.items()}
        finally:
            ray.shutdown()
    for mode, r in results.items():
        print(mode, " ".join(f"{k}={v:.1f}" for k, v in r.items()))
    p, i = results["processes"], results["in_process"]
    print(f"start_ratio_processes_over_in_process={p['start_s'] / i['start_s']:.2f} "
          f"warm_generate_ratio={p['generate2_s'] / i['generate2_s']:.2f}")


if __name__ == "__main__":
    main()
