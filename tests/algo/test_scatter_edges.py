"""Row advantage -> tokens, edge cases: backend dispatch, the numpy (huge page) allocation of large CPU outputs,
float32 outputs on the input's device whatever torch's defaults are, and the exact validation errors.

Complements test_scatter.py (values against the oracle); written to kill the mutants that survived it
(issue #43, /work/notes/mutmut-s33/scatter.md).
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from megatron_gigpo.algo.oracle import oracle_scatter_packed, oracle_scatter_padded
from megatron_gigpo.algo.scatter import (
    _HUGE_PAGE_MIN_BYTES,
    _empty_float32,
    _use_triton,
    scatter_advantages_packed,
    scatter_advantages_padded,
)

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def _numpy_bytes(fn):
    """Run ``fn()``; return its result and the bytes numpy allocated meanwhile that are still alive.

    Counts the growth of numpy's traced bytes, so that tracing already on (``PYTHONTRACEMALLOC``, ``-X
    tracemalloc``) neither adds older allocations nor gets switched off here."""
    numpy_only = [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)]

    def traced() -> int:
        return sum(stat.size for stat in tracemalloc.take_snapshot().filter_traces(numpy_only).statistics("filename"))

    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        before = traced()
        result = fn()
        return result, traced() - before
    finally:
        if started:
            tracemalloc.stop()


def test_backend_dispatch():
    cuda = torch.device("cuda")  # a device object needs no GPU
    assert _use_triton(CPU, "auto") is False
    assert _use_triton(cuda, "auto") is True
    for device in (CPU, cuda):
        assert _use_triton(device, "torch") is False
        assert _use_triton(device, "triton") is True
    with pytest.raises(ValueError, match="unknown scatter backend 'TORCH'"):
        _use_triton(CPU, "TORCH")


def test_large_cpu_outputs_come_from_numpy_small_ones_from_torch():
    limit = _HUGE_PAGE_MIN_BYTES // 4  # float32 elements of the smallest numpy-allocated output
    for shape, from_numpy in (((limit,), True), ((limit - 1,), False), ((2, limit // 2), True), ((3, 5), False)):
        out, numpy_bytes = _numpy_bytes(lambda: _empty_float32(shape, CPU))
        assert out.shape == shape and out.dtype == torch.float32 and out.device == CPU
        assert (numpy_bytes >= out.numel() * 4) is from_numpy, (shape, numpy_bytes)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_large_padded_scatter_is_exact_in_a_numpy_buffer(mask_dtype):
    rows, tokens = 64, _HUGE_PAGE_MIN_BYTES // 4 // 64  # exactly the huge-page threshold
    adv = torch.arange(rows, dtype=torch.float32) - 20.5
    mask = (torch.arange(rows * tokens).reshape(rows, tokens) % 3 != 0).to(mask_dtype)
    out, numpy_bytes = _numpy_bytes(lambda: scatter_advantages_padded(adv, mask, backend="torch"))
    assert numpy_bytes >= out.numel() * 4
    assert out.dtype == torch.float32 and out.shape == (rows, tokens)
    assert torch.equal(out, adv.unsqueeze(-1) * mask.to(torch.float32))


def test_outputs_are_float32_on_the_input_device_whatever_the_torch_defaults():
    adv = torch.tensor([1.5, -2.0, 0.25], dtype=torch.float64)
    mask_f64 = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    offsets = torch.tensor([1, 3, 3, 6])
    token_mask = torch.tensor([1, 1, 0, 1, 1, 0, 1], dtype=torch.float64)
    padded_ref = torch.tensor(oracle_scatter_padded(adv.tolist(), mask_f64.tolist()), dtype=torch.float32)
    packed_ref = torch.tensor(oracle_scatter_packed(adv.tolist(), offsets.tolist(), 7, None), dtype=torch.float32)
    masked_ref = torch.tensor(
        oracle_scatter_packed(adv.tolist(), offsets.tolist(), 7, token_mask.tolist()), dtype=torch.float32
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):  # factories without an explicit device would land on meta
            outs = [
                (scatter_advantages_padded(adv, mask_f64), padded_ref),
                (scatter_advantages_padded(adv, mask_f64 != 0), padded_ref),
                (scatter_advantages_padded(adv, mask_f64.to(torch.int64)), padded_ref),
                (scatter_advantages_packed(adv, offsets, 7), packed_ref),
                (scatter_advantages_packed(adv, offsets, 7, token_mask=token_mask), masked_ref),
                (scatter_advantages_packed(adv, offsets, 7, token_mask=token_mask != 0), masked_ref),
            ]
    finally:
        torch.set_default_dtype(previous)
    for i, (out, ref) in enumerate(outs):
        assert out.device == CPU and out.dtype == torch.float32, (i, out.device, out.dtype)
        assert torch.equal(out, ref), i


def test_empty_packed_sequences():
    out = scatter_advantages_packed(torch.zeros(0), torch.zeros(1, dtype=torch.int64), 0)
    assert out.shape == (0,) and out.dtype == torch.float32
    out = scatter_advantages_packed(torch.zeros(0), torch.tensor([2]), 4)
    assert torch.equal(out, torch.zeros(4))
    out = scatter_advantages_packed(torch.tensor([3.0]), torch.tensor([0, 0]), 0)
    assert out.shape == (0,)


def test_bad_inputs_raise_named_value_errors():
    adv = torch.zeros(2)
    meta = torch.device("meta")
    with pytest.raises(ValueError, match=r"row_adv must be 1-D \(B,\), got shape \(2, 1\)"):
        scatter_advantages_padded(adv.unsqueeze(-1), torch.ones(2, 4))
    with pytest.raises(ValueError, match="row_adv on cpu but response_mask on meta"):
        scatter_advantages_padded(adv, torch.ones(2, 4, device=meta))
    with pytest.raises(ValueError, match="row_adv on meta but offsets on cpu"):
        scatter_advantages_packed(torch.zeros(2, device=meta), torch.tensor([0, 1, 2]), 5)
    with pytest.raises(ValueError, match="row_adv on cpu but token_mask on meta"):
        scatter_advantages_packed(adv, torch.tensor([0, 1, 2]), 5, token_mask=torch.ones(5, device=meta))
    with pytest.raises(ValueError, match="total_tokens must be >= 0, got -1"):
        scatter_advantages_packed(adv, torch.tensor([0, 0, 0]), -1)
    # a single row is validated like any other
    with pytest.raises(ValueError, match=r"offsets must lie in \[0, total_tokens=5\], got 0..10"):
        scatter_advantages_packed(torch.ones(1), torch.tensor([0, 10]), 5)
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        scatter_advantages_packed(torch.ones(1), torch.tensor([3, 1]), 5)
    # the first offset, not the second, must be >= 0
    with pytest.raises(ValueError, match=r"offsets must lie in \[0, total_tokens=5\], got -1..2"):
        scatter_advantages_packed(adv, torch.tensor([-1, 1, 2]), 5)
