"""Environment throughput: steps/s with 64 parallel environments, and retrieval queries/s per retriever backend.

For each environment, ``--num-envs`` (64) instances are stepped with a random admissible policy, first all in
one process, then split over ``--procs`` worker processes (each owning a slice, as rollout env workers do).
Episodes that end are reset with the next task; reset time is reported apart from step time because
ALFWorld's resets (PDDL grounding) dominate its cost. Retrieval: the search-QA retrievers over the 1,000-passage
wiki-18 sample, single queries and batches.

Run from the repository root::

    python benchmarks/envs.py                        # sokoban, webshop (generated 1,000 products), alfworld*
    python benchmarks/envs.py --envs sokoban --rounds 50
    python benchmarks/envs.py --es-url http://127.0.0.1:9200 --dense-model /path/to/encoder

Every environment is set up the same way, from its registry recipe (``megatron_gigpo.envs.registry.env_recipe``):
an ``env`` section with the recipe defaults, the environment's own step limit (``EnvRecipe.step_limit``) and
``env.data_dir`` from ``--<name>-data-dir``, else from the environment's sample-data generator
(``EnvRecipe.sample_data``: WebShop's 1,000 generated products), else ``../shared/data/<name>`` beside the
checkout when it exists; then its ``env_kwargs`` and its train task list (the val list where only val data is
present, as in the shared ALFWorld games). An environment that cannot start here is a row with a note.

(*) ALFWorld and the retrieval part read ``--alfworld-data-dir`` / ``--corpus`` / ``--queries``, by default the
``../shared/data`` folder beside the checkout when it exists; missing inputs skip that row with a note.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


# An admissible action holding a <...> placeholder is a template (WebShop's search bar: search[<your query>]).
_PLACEHOLDER = re.compile(r"<[^<>]*>")


def random_action(env_name: str, admissible: list[str] | None, task_description: str, rng: random.Random) -> str:
    """A random admissible action; when the first admissible action is a template (a search bar), that template
    with the task description in its placeholder (a search for the instruction).

    Raises:
        ValueError: no admissible actions (the message names ``env_name``).
    """
    if admissible and _PLACEHOLDER.search(admissible[0]):
        return _PLACEHOLDER.sub(lambda _: task_description, admissible[0])
    if not admissible:
        raise ValueError(f"{env_name}: no admissible actions to sample from")
    return rng.choice(admissible)


def run_slice(
    env_name: str, env_kwargs: dict[str, Any], tasks: list, num_envs: int, rounds: int, offset: int, barrier=None
) -> dict:
    """Step ``num_envs`` environments for ``rounds`` rounds; returns step/reset counts and seconds.

    ``loop_s`` is the wall time of the stepping loop (after the environments are built and reset once, and
    after ``barrier`` when given, so that parallel slices start together).
    """
    from megatron_gigpo.envs.registry import make_env

    rng = random.Random(offset)
    envs = [make_env(env_name, **env_kwargs) for _ in range(num_envs)]
    stats = {"steps": 0, "step_s": 0.0, "resets": 0, "reset_s": 0.0}
    next_task = offset

    def reset(i: int) -> list:
        nonlocal next_task
        t0 = time.perf_counter()
        result = envs[i].reset(tasks[next_task % len(tasks)], seed=0)
        stats["reset_s"] += time.perf_counter() - t0
        stats["resets"] += 1
        next_task += 1
        return [result.admissible_actions, result.task_description]

    state = [reset(i) for i in range(num_envs)]
    if barrier is not None:
        barrier.wait()
    loop_start = time.perf_counter()
    for _ in range(rounds):
        for i, env in enumerate(envs):
            action = random_action(env_name, state[i][0], state[i][1], rng)
            t0 = time.perf_counter()
            result = env.step(action)
            stats["step_s"] += time.perf_counter() - t0
            stats["steps"] += 1
            state[i][0] = result.admissible_actions
            if result.done:
                state[i] = reset(i)
    stats["loop_s"] = time.perf_counter() - loop_start
    for env in envs:
        env.close()
    return stats


def _slice_entry(queue, barrier, *args) -> None:
    queue.put(run_slice(*args, barrier=barrier))


def bench_env(env_name: str, env_kwargs: dict, tasks: list, num_envs: int, rounds: int, procs: int) -> dict:
    """Throughput of ``num_envs`` environments in one process, then split over ``procs`` processes."""
    serial = run_slice(env_name, env_kwargs, tasks, num_envs, rounds, 0)
    sizes = [num_envs // procs + (1 if r < num_envs % procs else 0) for r in range(procs)]
    sizes = [n for n in sizes if n]
    ctx = mp.get_context("spawn")  # fresh interpreters, like Ray env workers
    queue, barrier = ctx.Queue(), ctx.Barrier(len(sizes))
    workers = [
        ctx.Process(target=_slice_entry, args=(queue, barrier, env_name, env_kwargs, tasks, n, rounds, sum(sizes[:r])))
        for r, n in enumerate(sizes)
    ]
    for w in workers:
        w.start()
    parts = [queue.get() for _ in workers]
    for w in workers:
        w.join()
    return {
        "env": env_name,
        "steps/s (step calls only)": serial["steps"] / serial["step_s"],
        "resets/s": serial["resets"] / serial["reset_s"],
        "steps/s (1 proc, incl. resets)": serial["steps"] / serial["loop_s"],
        f"steps/s ({len(sizes)} procs, incl. resets)": sum(p["steps"] for p in parts) / max(p["loop_s"] for p in parts),
    }


def bench_retrievers(corpus: Path, queries_file: Path, args: argparse.Namespace) -> list[dict]:
    """Queries/s of each retriever backend that can be built here."""
    from megatron_gigpo.envs.search_qa.backends import build_retriever
    from megatron_gigpo.envs.search_qa.datasets import read_qa_file

    questions = [r.question for r in read_qa_file(queries_file)][: args.num_queries]
    rows = []
    backends: list[tuple[str, dict]] = [("bm25", {"corpus_path": str(corpus)})]
    if args.es_url:
        backends.append(("elasticsearch", {"url": args.es_url, "index": "bench_wiki18_sample"}))
    else:
        rows.append({"backend": "elasticsearch", "note": "skipped: no --es-url"})
    if args.dense_model:
        backends.append(("dense", {"corpus_path": str(corpus), "model_name_or_path": args.dense_model}))
    else:
        rows.append({"backend": "dense", "note": "skipped: no --dense-model"})
    for backend, kwargs in backends:
        try:
            if backend == "elasticsearch":
                _load_es_index(args.es_url, kwargs["index"], corpus)
            t0 = time.perf_counter()
            retriever = build_retriever(backend, **kwargs)
            build_s = time.perf_counter() - t0
        except (ImportError, ConnectionError, OSError, ValueError) as exc:
            rows.append({"backend": backend, "note": f"skipped: {type(exc).__name__}: {exc}"})
            continue
        t0 = time.perf_counter()
        for q in questions:
            retriever.search(q, args.top_k)
        single = len(questions) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(0, len(questions), 64):
            retriever.batch_search(questions[i : i + 64], args.top_k)
        batched = len(questions) / (time.perf_counter() - t0)
        retriever.close()
        rows.append({"backend": backend, "build s": build_s, "queries/s": single, "queries/s (batch 64)": batched})
    return rows


def _load_es_index(url: str, index: str, corpus: Path) -> None:
    from megatron_gigpo.envs.search_qa.elastic import build_elasticsearch_index, make_client
    from megatron_gigpo.envs.search_qa.passages import read_passages

    client = make_client(url)
    try:
        build_elasticsearch_index(client, url, index, read_passages(corpus), recreate=True)
    finally:
        client.close()


def _data_dir(name: str, args: argparse.Namespace, tmp: Path) -> Path | None:
    """``env.data_dir`` of environment ``name``: ``--<name>-data-dir``, else sample data generated under ``tmp``
    (``EnvRecipe.sample_data``), else ``../shared/data/<name>`` when it exists, else None."""
    from megatron_gigpo.envs.registry import env_recipe

    chosen = getattr(args, f"{name}_data_dir")
    sample_data = env_recipe(name).sample_data
    if chosen is None and sample_data is not None:
        chosen = tmp / name
        sample_data(chosen)
    elif chosen is None and (SHARED_DATA / name).is_dir():
        chosen = SHARED_DATA / name
    return chosen


def env_setup(name: str, args: argparse.Namespace, tmp: Path) -> tuple[str, dict, list] | tuple[str, str]:
    """``(name, make_env kwargs, tasks)`` of a registered environment, from its recipe hooks and an ``env`` section
    with the recipe defaults, or ``(name, note)`` when it cannot start here.

    ``tasks`` is the train task list (the val list when the train data is missing), cut to the
    ``num_envs * (rounds + 1)`` tasks a run can reach.
    """
    from megatron_gigpo.config import EnvConfig
    from megatron_gigpo.envs.registry import env_recipe

    recipe = env_recipe(name)
    data_dir = _data_dir(name, args, tmp)
    env = EnvConfig(name=name, data_dir=None if data_dir is None else str(data_dir))
    if recipe.step_limit is not None:
        env.max_steps = recipe.step_limit
    try:
        kwargs = recipe.env_kwargs(env)
        try:
            tasks = recipe.task_list(env, "train")
        except FileNotFoundError:
            tasks = recipe.task_list(env, "val")
    except (FileNotFoundError, ValueError) as exc:
        flag = f" (--{name.replace('_', '-')}-data-dir)" if data_dir is None else ""
        return name, f"skipped: {exc}{flag}"
    return name, kwargs, tasks[: args.num_envs * (args.rounds + 1)]


def _print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    for row in rows:
        print("  " + " | ".join(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()))


def main(argv: list[str] | None = None) -> int:
    from megatron_gigpo.envs.registry import ENVIRONMENTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", default=["sokoban", "webshop", "alfworld"], choices=list(ENVIRONMENTS))
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20, help="steps per environment")
    parser.add_argument("--procs", type=int, default=2)
    for name in ENVIRONMENTS:
        parser.add_argument(f"--{name.replace('_', '-')}-data-dir", dest=f"{name}_data_dir", type=Path, default=None,
                            help=f"env.data_dir of {name}, for an environment that reads a data folder")
    parser.add_argument("--corpus", type=Path, default=SHARED_DATA / "search_qa" / "wiki18_sample_1000.jsonl")
    parser.add_argument("--queries", type=Path, default=SHARED_DATA / "search_qa" / "nq_test_1k.jsonl")
    parser.add_argument("--num-queries", type=int, default=500)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--es-url", default=None)
    parser.add_argument("--dense-model", default=None)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        env_rows = []
        for setup in (env_setup(name, args, Path(tmp)) for name in args.envs):
            if len(setup) == 2:
                env_rows.append({"env": setup[0], "note": setup[1]})
                continue
            name, kwargs, tasks = setup
            env_rows.append(bench_env(name, kwargs, tasks, args.num_envs, args.rounds, args.procs))
        _print_rows(f"environments: {args.num_envs} parallel, random admissible policy, {args.rounds} rounds", env_rows)
        for row in env_rows:
            serial = [v for k, v in row.items() if k == "steps/s (1 proc, incl. resets)"]
            parallel = [v for k, v in row.items() if "procs, incl. resets" in k]
            if serial and parallel:
                print(f"  {row['env']}: {args.procs} procs / 1 proc throughput = {parallel[0] / serial[0]:.2f}x")
    if args.corpus.is_file() and args.queries.is_file():
        rows = bench_retrievers(args.corpus, args.queries, args)
        _print_rows(f"retrievers over {args.corpus.name}, top_k={args.top_k}", rows)
    else:
        print(f"\n== retrievers: skipped, corpus {args.corpus} or queries {args.queries} not found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
