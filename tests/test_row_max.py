"""The CPU kernels' row_max (workers/cpu/csrc/row_max.cpp), the sampler's greedy argmax: the values
and first indices torch.max(dim=-1) gives, on ties, NaN, +inf and all -inf rows, odd widths
(the vector loop's tail), strided rows, in float32 and bfloat16; and the sampler's greedy tokens
with it."""

from __future__ import annotations

import pytest
import torch

from kernel_requirements import requires_kernels
from workers.cpu import kernels as cpu_ops
from workers.model.backend import TORCH, CpuKernelBackend

pytestmark = requires_kernels


def _check(x: torch.Tensor) -> None:
    values, indices = torch.ops.tpserve_cpu.row_max(x)
    ref_values, ref_indices = x.max(dim=-1)
    assert torch.equal(indices, ref_indices)
    assert values.dtype == x.dtype
    assert torch.equal(values.isnan(), ref_values.isnan())
    assert torch.equal(values.nan_to_num(), ref_values.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 49152])
def test_row_max_equals_torch_max(width, dtype):
    torch.manual_seed(width)
    x = torch.randn(9, width).to(dtype)
    # Ties: the first index wins (row 1 has its maximum three times, in the tail too).
    x[1] = 0.0
    x[1, [width // 3, width // 2, width - 1]] = 5.0
    x[2] = float("-inf")
    x[3, width // 2] = float("inf")
    x[4, width - 1] = float("nan")
    x[5, [width // 4, width - 1]] = float("nan")
    x[6, 0] = float("inf")
    x[6, width - 1] = float("nan")
    x[7] = float("nan")
    # bf16 keeps 8 bits of mantissa: near-equal values round to ties the float32 rows lack.
    x[8] = torch.arange(width) % 7 / 64
    _check(x)


def test_row_max_takes_strided_rows_and_refuses_other_dtypes():
    torch.manual_seed(0)
    wide = torch.randn(6, 300)
    for rows in (wide, wide.bfloat16()):
        _check(rows[:, 7:250])
        _check(rows[::2, :])
        _check(rows.t().contiguous().t()[:, :5])  # columns contiguous: copied first
    for dtype in (torch.float16, torch.float64):
        with pytest.raises(RuntimeError, match="float32 or bfloat16"):
            torch.ops.tpserve_cpu.row_max(wide.to(dtype))


def test_the_sampler_s_row_max_takes_the_kernel_only_when_told(monkeypatch):
    """The kernel backend's row_max calls the kernel for CPU float32 and bfloat16 rows, torch's max
    otherwise (float64 rows), and the torch backend never does; the results are the same."""
    calls = []
    kernel = torch.ops.tpserve_cpu.row_max
    monkeypatch.setattr(torch.ops.tpserve_cpu, "row_max", lambda x: calls.append(x.shape) or kernel(x))
    KERNELS = CpuKernelBackend(prefill_attention=False, layer_stack=False)
    torch.manual_seed(1)
    x = torch.randn(4, 1000)
    x[2, 10] = float("nan")
    for on, dtype, expected_calls in ((False, torch.float32, 0), (True, torch.float32, 1), (True, torch.bfloat16, 2),
                                      (True, torch.float64, 2)):
        ref_values, ref_indices = x.to(dtype).max(dim=-1)
        values, indices = (KERNELS if on else TORCH).row_max(x.to(dtype))
        assert len(calls) == expected_calls
        assert torch.equal(indices, ref_indices) and values.isnan().tolist() == [False, False, True, False]
