"""The ``megatron-gigpo`` command line: demos, sft, train, eval, validate, convert, plot, serve-retriever."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path


#: ``validate --plan``'s GPU size when ``--gpu-memory-gib`` is not given (an 80 GiB A100/H100).
DEFAULT_GPU_MEMORY_GIB = 80.0


def _cmd_validate(args: argparse.Namespace) -> int:
    from megatron_gigpo.config import load_config

    for given, option in ((args.gpu_memory_gib is not None, "--gpu-memory-gib"),
                          (args.allow_over_memory, "--allow-over-memory")):
        if given and not args.plan:
            print(f"megatron-gigpo validate: {option} is only read with --plan", file=sys.stderr)
            return 2
    if (args.nodes is None) != (args.gpus_per_node is None):
        print("megatron-gigpo validate: --nodes and --gpus-per-node go together (the job's allocation)",
              file=sys.stderr)
        return 2
    from megatron_gigpo.cluster.preflight import Allocation, check_allocation, preflight

    cfg = load_config(args.recipe, args.overrides)
    model = cfg.model.path
    allocation = None if args.nodes is None else Allocation(args.nodes, args.gpus_per_node)
    if args.preflight:
        preflight(cfg, allocation=allocation)
        cfg = _local_model(cfg, download=False)  # a hub id: its cached snapshot, which --plan then reads
    elif allocation is not None:
        check_allocation(cfg, allocation)
    p, r = cfg.parallel, cfg.rollout
    print(
        f"{args.recipe}: ok — model {model}, env {cfg.env.name}, "
        f"TP{p.tensor_model_parallel_size} x PP{p.pipeline_model_parallel_size} x DP{p.data_parallel_size} "
        + (f"(EP{p.expert_model_parallel_size} x expert TP{p.expert_tensor_parallel}) "
           if p.expert_model_parallel_size > 1 else "")
        + f"on {cfg.trainer.nnodes} node(s) x {cfg.trainer.devices_per_node} {cfg.trainer.device} device(s), "
        f"{r.num_engines} engine(s) x TP{r.tensor_parallel_size}, {cfg.env.num_groups} groups x {r.n} rollouts"
    )
    if args.plan:
        refusal = _print_plan(cfg, DEFAULT_GPU_MEMORY_GIB if args.gpu_memory_gib is None else args.gpu_memory_gib)
        if refusal and not args.allow_over_memory:
            print(f"megatron-gigpo validate: does not fit: {refusal}; or pass --allow-over-memory", file=sys.stderr)
            return 2
        if refusal:
            print(f"megatron-gigpo validate: --allow-over-memory: going on although {refusal.split(';')[0]}")
    return 0


def _print_plan(cfg, gpu_memory_gib: float) -> str | None:
    """Print the placement plan (megatron_gigpo.cluster.placement) and, on GPU, its per-GPU memory estimate;
    return the estimate's refusal (:func:`megatron_gigpo.cluster.memory.memory_refusal`), None if it fits or
    there is no estimate."""
    from megatron_gigpo.cluster.memory import (estimate_memory, format_experts, format_memory, memory_refusal,
                                               policy_hf_config)
    from megatron_gigpo.cluster.placement import format_plan, plan_placement

    plan = plan_placement(cfg)
    print(format_plan(plan))
    if plan.cluster.device != "cuda":
        print("memory: trainer.device=cpu, no GPU estimate")
        return None
    hf = policy_hf_config(cfg)
    if hf is None:
        print(f"memory: no estimate, the architecture of model.path '{cfg.model.path}' is unknown")
        return None
    from megatron_gigpo.models.mapping import UnsupportedModelError

    try:
        rows = estimate_memory(cfg, plan, hf, gpu_memory_gib)
    except UnsupportedModelError as exc:  # the family's mapping states its q/k/v biases: none, no estimate
        print(f"memory: no estimate for model.path '{cfg.model.path}': {exc}")
        return None
    experts = format_experts(cfg, hf)
    if experts:
        print(experts)
    print(format_memory(rows, gpu_memory_gib))
    return memory_refusal(rows, gpu_memory_gib)


def _count(least: int):
    """An argparse type: a whole number >= ``least``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= {least}")
        return value

    parse.__name__ = "whole number"  # argparse's message on a ValueError: "invalid whole number value"
    return parse


def _gib(text: str) -> float:
    """``--gpu-memory-gib``: a positive, finite number of GiB (argparse names the option on a ValueError)."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive, finite number of GiB")
    return value


def _local_model(cfg, *, download: bool = True):
    """``cfg`` whose ``model.path`` is a local directory: a hub id resolved once, here, through the Hugging Face
    cache before anything starts (downloaded into it when ``download`` and not ``HF_HUB_OFFLINE``), so that every
    reader after it gets the snapshot directory (megatron_gigpo.models.hub)."""
    from megatron_gigpo.models.hub import with_local_model

    return with_local_model(cfg, download=download)


def _cmd_train(args: argparse.Namespace) -> int:
    from megatron_gigpo.actor.checkpoint_layout import latest_checkpoint
    from megatron_gigpo.config import load_config
    from megatron_gigpo.driver import train
    from megatron_gigpo.run.preemption import stop_on_signals
    from megatron_gigpo.sft.cold_start import cold_start

    cfg = load_config(args.recipe, args.overrides)
    found = latest_checkpoint(cfg.checkpoint_root) if cfg.checkpoint.resume else None
    if found is not None and found[0] >= cfg.trainer.total_iterations:
        # Nothing to do: say so before Ray, the actors and the engines start.
        print(f"megatron-gigpo: nothing to train: {found[1]} is iteration {found[0]} and "
              f"trainer.total_iterations={cfg.trainer.total_iterations}; raise it to train further")
        return 0
    cfg = _local_model(cfg)  # a hub id: its cached (or downloaded) snapshot
    with stop_on_signals():  # SIGTERM/SIGUSR1: checkpoint, then exit RESUME_EXIT_CODE (main)
        cfg = cold_start(cfg)  # sft.enabled: demonstrations and SFT first (each skipped once done)
        train(cfg)
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from megatron_gigpo.config import load_config
    from megatron_gigpo.run.preemption import stop_on_signals
    from megatron_gigpo.sft.cold_start import with_sft_data
    from megatron_gigpo.sft.trainer import run_sft

    cfg = _local_model(load_config(args.recipe, args.overrides))
    with stop_on_signals():  # as `train`
        run_sft(with_sft_data(cfg))  # sft.train_file null: the expert's demonstrations (sft.demos)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from megatron_gigpo.actor.checkpoint_layout import checkpoint_from_cli
    from megatron_gigpo.config import load_config
    from megatron_gigpo.driver import evaluate
    from megatron_gigpo.sft.cold_start import from_cold_start

    cfg = from_cold_start(load_config(args.recipe, args.overrides))  # the model RL started from
    found = checkpoint_from_cli(args.checkpoint, "--checkpoint")
    cfg = _local_model(cfg)
    print(f"megatron-gigpo: evaluating {found[1]} (iteration {found[0]})")
    metrics = evaluate(cfg, checkpoint=str(found[1]))
    for key in sorted(metrics):
        print(f"{key}: {metrics[key]:.4f}")
    return 0


def _cmd_demos(args: argparse.Namespace) -> int:
    from megatron_gigpo.config import load_config
    from megatron_gigpo.demos.writer import write_demos

    cfg = _local_model(load_config(args.recipe, args.overrides))
    d = cfg.sft.demos  # the recipe's values, unless a flag overrides them
    with _sigterm_as_exit():  # a time limit's SIGTERM: finished episodes are kept for a re-run
        stats = write_demos(cfg, args.out, d.num_episodes if args.num_episodes is None else args.num_episodes,
                            d.epsilon if args.epsilon is None else args.epsilon,
                            d.seed if args.seed is None else args.seed, reasoning=args.reasoning or d.reasoning)
    print(
        f"megatron-gigpo: wrote {stats.rows} rows of {stats.episodes} {cfg.env.name} episodes to {args.out} "
        f"(success rate {stats.success_rate:.3f}, mean steps {stats.mean_steps:.2f}, random share "
        f"{stats.random_share:.3f}, skipped {stats.skipped}, {stats.episodes_per_s:.1f} episodes/s)"
    )
    print(f"megatron-gigpo: episode ends: {stats.end_reasons}")
    return 0


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """While inside: SIGTERM (``kill``, Slurm's time limit) raises ``SystemExit(143)`` in the main thread, so
    that ``finally`` and ``except BaseException`` clean-ups run as they do for Ctrl-C."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _cmd_plot(args: argparse.Namespace) -> int:
    from megatron_gigpo.run.plots import plot_run

    for path in plot_run(Path(args.run_dir)):
        print(path)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    """The converters of tools/convert_*.py; multi-process: ``torchrun ... -m megatron_gigpo.cli convert ...``."""
    from megatron_gigpo.actor.convert import main_hf_to_megatron, main_megatron_to_hf

    main_fn = main_hf_to_megatron if args.direction == "hf-to-megatron" else main_megatron_to_hf
    return main_fn(args.tool_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-gigpo", description="GiGPO training of multi-turn LLM agents on Megatron-core and vLLM: "
        "expert demonstrations, SFT cold start, RL, evaluation, checks, conversion and plots.",
        epilog="Each command's options: megatron-gigpo COMMAND --help. Documentation: README.md and docs/.")
    sub = parser.add_subparsers(dest="command", required=True)

    def recipe_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("recipe", help="recipe YAML, e.g. recipes/smoke/cpu.yaml")
        p.add_argument("overrides", nargs="*", help="section.key=value overrides")
        return p

    recipe_cmd("sft", "supervised cold start on the recipe's sft.train_file demonstrations; writes "
                      "<run dir>/sft/hf").set_defaults(func=_cmd_sft)
    recipe_cmd("train", "train a policy with GiGPO").set_defaults(func=_cmd_train)
    ev = recipe_cmd("eval", "evaluate a checkpoint on the recipe's validation tasks")
    ev.add_argument("--checkpoint", required=True,
                    help="a checkpoint folder (checkpoints/iter_N) or a run's checkpoints/ folder (its newest)")
    ev.set_defaults(func=_cmd_eval)
    va = recipe_cmd("validate", "check a recipe without starting anything")
    va.add_argument("--preflight", action="store_true", help="also check data directories, devices and services")
    va.add_argument("--plan", action="store_true",
                    help="print the placement plan (bundles, ranks, engines, GPU count) and a per-GPU memory estimate; "
                         "exit 2 when a GPU does not fit")
    va.add_argument("--gpu-memory-gib", type=_gib, default=None,
                    help=f"GPU memory for the --plan estimate (GiB, default {DEFAULT_GPU_MEMORY_GIB:g}); only with --plan")
    va.add_argument("--nodes", type=_count(1), default=None,
                    help="the job's nodes (sbatch --nodes); with --gpus-per-node: refuse a recipe whose "
                         "trainer.nnodes and trainer.devices_per_node differ (with --preflight: instead of counting "
                         "this machine's GPUs)")
    va.add_argument("--gpus-per-node", type=_count(0), default=None,
                    help="the job's GPUs per node (sbatch --gpus-per-node); only with --nodes")
    va.add_argument("--allow-over-memory", action="store_true",
                    help="with --plan: exit 0 although a GPU's estimated peak exceeds its memory (default: exit 2)")
    va.set_defaults(func=_cmd_validate)
    de = recipe_cmd("demos", "write expert demonstrations (chat JSONL) for a supervised cold start")
    de.add_argument("--out", required=True, help="JSONL file to write; finished episodes go to OUT.partial first "
                    "(renamed at the end), and a stopped run resumes from them when run again with the same arguments")
    de.add_argument("--num-episodes", type=int, help="training tasks to play (default: sft.demos.num_episodes)")
    de.add_argument("--epsilon", type=float,
                    help="share of steps taking a uniformly random admissible action instead (default: sft.demos.epsilon)")
    de.add_argument("--reasoning", choices=["plan", "none"],
                    help="think-block text: the expert's short plan, or empty (default: sft.demos.reasoning)")
    de.add_argument("--seed", type=int, help="task order, resets and epsilon draws (default: sft.demos.seed)")
    de.set_defaults(func=_cmd_demos)
    pl = sub.add_parser("plot", help="write PNG curves of a run")
    pl.add_argument("run_dir")
    pl.set_defaults(func=_cmd_plot)
    co = sub.add_parser("convert", help="HF <-> Megatron checkpoint conversion (tools/convert_*.py)")
    co.add_argument("direction", choices=["hf-to-megatron", "megatron-to-hf"])
    co.add_argument("tool_args", nargs=argparse.REMAINDER, help="arguments passed to the converter tool")
    co.set_defaults(func=_cmd_convert)
    # Listed for --help only: main() hands everything after the name to the server's own parser, since an
    # argparse REMAINDER cannot start with an option.
    sub.add_parser("serve-retriever", help="serve a search-QA retriever over HTTP (tools/retrieval_server.py --help)")
    return parser


class _CurrentStderr(logging.StreamHandler):
    """A handler that writes to ``sys.stderr`` as it is at each record, not as it was when installed (a test's
    captured stderr is closed after the test; the records of later ``load_config`` calls go to the next one)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def console_logging() -> None:
    """The package's own progress lines (resume point, skipped iterations, prompt overflows): its INFO records on
    stderr, prefixed ``megatron-gigpo:``. Installed once per process."""
    package_log = logging.getLogger("megatron_gigpo")
    if not package_log.handlers:
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("megatron-gigpo: %(message)s"))
        package_log.addHandler(handler)
        package_log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    from megatron_gigpo.config import ConfigError
    from megatron_gigpo.cluster.preflight import PreflightError
    from megatron_gigpo.run.preemption import RESUME_EXIT_CODE, StoppedBySignal
    from megatron_gigpo.sft import SFTDataError

    argv = sys.argv[1:] if argv is None else argv
    # Megatron-core's import-time notice on machines without its GPU fusions (the CPU path never uses them).
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed", category=UserWarning)
    if argv[:1] == ["serve-retriever"]:
        from megatron_gigpo.envs.search_qa.server import main as serve_retriever

        return serve_retriever(argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow options (`demos RECIPE --out F env.max_steps=9`); argparse leaves those over.
    if extra and hasattr(args, "overrides") and not any(item.startswith("-") for item in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    console_logging()
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"megatron-gigpo: config error: {exc}", file=sys.stderr)
        return 2
    except (PreflightError, SFTDataError, FileNotFoundError, FileExistsError) as exc:
        # Missing or clashing files (a run directory, a checkpoint, a model, a demonstration file) are the
        # user's to fix: one line.
        print(f"megatron-gigpo: {exc}", file=sys.stderr)
        return 2
    except StoppedBySignal as exc:  # train / sft after SIGTERM or SIGUSR1: checkpointed, resume me
        print(f"megatron-gigpo: {exc}", file=sys.stderr, flush=True)
        return RESUME_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
