"""What reaches the terminal: known-harmless vLLM warnings are kept off it (they stay in the log files)."""

import logging

import pytest

from megatron_gigpo.logs import DropHarmless

pytestmark = pytest.mark.unit


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("vllm.v1.worker.cpu_worker", logging.WARNING, __file__, 1, message, None, None)


@pytest.mark.parametrize("message", [
    "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.",
    "The global random seed is set to 1. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False, this may affect ...",
    "RotaryEmbedding: Failed to load weights",
])
def test_known_harmless_warnings_are_dropped(message):
    assert not DropHarmless().filter(_record(message))


def test_other_warnings_reach_the_terminal():
    assert DropHarmless().filter(_record("KV cache is full; preempting requests"))
