"""Time breakdown of one training iteration of a recipe (default: the CPU smoke recipe).

    python benchmarks/iteration.py [--recipe recipes/smoke/cpu.yaml] [overrides ...]

Runs ``megatron-gigpo train`` for one iteration in a fresh run directory and prints the wall time of each
phase (rollout, old/reference log-probs, advantage, update, resharding) as a table with its share of the
iteration, then ``iteration_s=<x>``. Start-up (Ray, model build, engine start) is excluded.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from megatron_gigpo.config import load_config
from megatron_gigpo.driver import train
from megatron_gigpo.run.metrics import read_metrics

PHASES = ("rollout", "old_log_prob", "ref_log_prob", "advantage", "update", "resharding")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(Path(__file__).resolve().parents[1] / "recipes/smoke/cpu.yaml"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gigpo-iteration-") as out:
        cfg = load_config(args.recipe, [
            f"trainer.output_dir={out}", "trainer.total_iterations=1", "trainer.val_before_train=false",
            "trainer.val_every=0", "checkpoint.save_every=0", "logging.progress_bars=false", *args.overrides,
        ])
        train(cfg)
        (record,) = read_metrics(cfg.run_dir)
    total = record["timing/iteration_s"]
    print(f"{'phase':<14}{'seconds':>10}{'share':>9}")
    for phase in PHASES:
        key = f"timing/{phase}_s"
        if key in record:
            print(f"{phase:<14}{record[key]:>10.2f}{record[key] / total:>9.1%}")
    print(f"{'iteration':<14}{total:>10.2f}{1:>9.0%}")
    print(f"rows={record['batch/rows']:.0f} tokens_per_s={record['perf/tokens_per_s']:.1f}")
    print(f"iteration_s={total:.2f}")


if __name__ == "__main__":
    main()
