"""Synchronous against asynchronous rollout (issue #41 item 5): wall time per iteration and who sat idle.

    python benchmarks/async.py [--recipe recipes/cpu/sokoban.yaml] [--iterations 4] [--step-latency 0.5]
                               [--modes sync,k1,k2] [overrides ...]

Runs ``megatron-gigpo train`` once per mode on one recipe and one budget (default: the main job's recipe shrunk
to 8 groups x 4 episodes x at most 4 steps, random weights, no cold start, 4 iterations), engines on their own
placement bundles (``rollout.weight_sync_mode=disaggregated``):

    ======  ==========================================================================================
    sync    the synchronous loop: rollout, then old log-probs, update and sync while the engines wait
    k1      ``rollout.asynchronous.enabled=true``, ``max_staleness=1`` (groups at most one version old),
            ``algorithm.rollout_correction.mode=tis`` (decoupled PPO: the behaviour policy is the engine's)
    k2      the same with ``max_staleness=2``
    ======  ==========================================================================================

It drops each run's first iteration (the asynchronous producer has nothing queued yet) and prints per mode the
mean wall time per iteration (``timing/iteration_s``), the share of it the actor sat idle (sync: the rollout
phase; async: waiting for a batch, ``timing/rollout_s``, plus waiting for the round in flight before a sync,
``async/drain_wait_s``) and the share the engines sat idle (sync: everything but the rollout; async: the
producer parked at admission or behind a sync, ``async/engine_wait_s``), the mean and largest staleness, and
ends with ``async_speedup_k1=``, ``async_speedup_k2=`` and ``async_speedup=`` (sync time per iteration over the
best asynchronous one).

``--step-latency`` sets ``env.step_latency_s``: each environment step call waits that long before returning,
as a remote environment or tool server would. Waiting takes no core, so on a 2-core machine the actor can train
while the rollout waits: the overlap is real. With ``--step-latency 0`` rollout and training compete for the
same two cores and little overlap is possible. What the overlap buys on GPUs: docs/benchmarks.md.

It is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ASYNC = ("rollout.asynchronous.enabled=true", "algorithm.rollout_correction.mode=tis")
MODES: dict[str, tuple[str, ...]] = {
    "sync": (),
    "k1": ASYNC + ("rollout.asynchronous.max_staleness=1",),
    "k2": ASYNC + ("rollout.asynchronous.max_staleness=2",),
}
# trainer.old_log_probs=recompute in every mode: asynchronous rollout needs it (the main job's recipe takes the
# engine's), and the synchronous baseline then does the same work per row.
SHRINK = ("env.num_groups=8", "rollout.n=4", "env.max_steps=4", "trainer.ppo_mini_batch_size=16",
          "model.init=random", "sft.enabled=false", "trainer.old_log_probs=recompute")


def _train(recipe: str, out: Path, mode: str, iterations: int, latency: float, overrides: list[str]) -> list[dict]:
    from megatron_gigpo.run.metrics import read_metrics

    cmd = [sys.executable, "-m", "megatron_gigpo.cli", "train", recipe, f"trainer.output_dir={out}",
           f"trainer.experiment_name={mode}", f"trainer.total_iterations={iterations}", "trainer.val_every=0",
           "trainer.val_before_train=false", "checkpoint.save_every=0", "logging.progress_bars=false",
           "rollout.weight_sync_mode=disaggregated", f"env.step_latency_s={latency}", *SHRINK, *MODES[mode],
           *overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return read_metrics(out / mode)


def _summary(records: list[dict], mode: str) -> dict[str, float]:
    """Means over the iterations after the first: seconds per iteration, idle shares, staleness."""
    steady = [r for r in records if r["step"] > 1] or records
    total = np.array([r["timing/iteration_s"] for r in steady])
    rollout = np.array([r.get("timing/rollout_s", 0.0) for r in steady])
    if mode == "sync":
        actor_idle, engine_idle = rollout, total - rollout
    else:
        actor_idle = rollout + np.array([r.get("async/drain_wait_s", 0.0) for r in steady])
        engine_idle = np.array([r.get("async/engine_wait_s", 0.0) for r in steady])
    return {"s_per_iteration": float(total.mean()), "actor_idle": float((actor_idle / total).mean()),
            "engine_idle": float(np.clip(engine_idle / total, 0, 1).mean()),
            "staleness_mean": float(np.mean([r.get("async/staleness_mean", 0.0) for r in steady])),
            "staleness_max": float(max(r.get("async/staleness_max", 0.0) for r in steady))}


def _modes(text: str) -> list[str]:
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    if "sync" not in modes or len(modes) < 2 or any(m not in MODES for m in modes):
        raise argparse.ArgumentTypeError(f"--modes {text!r}: sync and at least one of k1,k2")
    return modes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(ROOT / "recipes/cpu/sokoban.yaml"))
    parser.add_argument("--iterations", type=int, default=4, help="iterations per run (the first is dropped)")
    parser.add_argument("--step-latency", type=float, default=0.5, help="env.step_latency_s, seconds per step call")
    parser.add_argument("--modes", type=_modes, default=list(MODES), help="comma-separated: sync,k1,k2")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides for every run")
    args = parser.parse_args()
    if args.iterations < 2:
        parser.error("--iterations must be at least 2 (the first iteration is dropped)")
    with tempfile.TemporaryDirectory(prefix="gigpo-async-") as out:
        results = {m: _summary(_train(args.recipe, Path(out), m, args.iterations, args.step_latency,
                                      args.overrides), m) for m in args.modes}
    print(f"\nstep latency {args.step_latency:g} s; iterations 2..{args.iterations} of each run")
    print(f"{'mode':<6}{'s/iteration':>13}{'actor idle':>12}{'engine idle':>13}{'staleness':>11}{'max':>5}")
    for mode, r in results.items():
        print(f"{mode:<6}{r['s_per_iteration']:>13.2f}{r['actor_idle']:>12.1%}{r['engine_idle']:>13.1%}"
              f"{r['staleness_mean']:>11.2f}{r['staleness_max']:>5.0f}")
    speedups = {m: results["sync"]["s_per_iteration"] / r["s_per_iteration"] for m, r in results.items() if m != "sync"}
    for mode, value in speedups.items():
        print(f"async_speedup_{mode}={value:.2f}")
    print(f"async_speedup={max(speedups.values()):.2f}")


if __name__ == "__main__":
    main()
