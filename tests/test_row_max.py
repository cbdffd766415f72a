"""The CPU kernels' row_max (workers/cpu/csrc/row_max.cpp), the sampler's greedy argmax: the values
and first indices torch.max(dim=-1) gives, on ties, NaN, +inf and all -inf rows, odd widths
(the vector loop's tail), strided rows; and the sampler's greedy tokens with it."""

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
    assert torch.equal(values.isnan(), ref_values.isnan())
    assert torch.equal(values.nan_to_num(), ref_values.nan_to_num())


@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 49152])
def test_row_max_equals_torch_max(width):
    torch.manual_seed(width)
    x = torch.randn(9, width)
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
    _check(x)


def test_row_max_takes_strided_rows_and_refuses_other_dtypes():
    torch.manual_seed(0)
    wide = torch.randn(6, 300)
    _check(wide[:, 7:250])
    _check(wide[::2, :])
    _check(wide.t().contiguous().t()[:, :5])  # columns contiguous: copied first
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.tpserve_cpu.row_max(wide.bfloat16())


def test_the_sampler_s_row_max_takes_the_kernel_only_when_told(monkeypatch):
    """The kernel backend's row_max calls the kernel for CPU float32 rows, torch's max otherwise
    (non-float32 rows too), and the torch backend never does; the results are the same."""
    calls = []
    kernel = torch.ops.tpserve_cpu.row_max
    monkeypatch.setattr(torch.ops.tpserve_cpu, "row_max", lambda x: calls.append(x.shape) or kernel(x))
    KERNELS = CpuKernelBackend(prefill_attention=False, layer_stack=False)
    torch.manual_seed(1)
    x = torch.randn(4, 1000)
    x[2, 10] = float("nan")
    ref_values, ref_indices = x.max(dim=-1)
    for on, dtype, expected_calls in ((False, torch.float32, 0), (True, torch.float32, 1), (True, torch.float64, 1)):
        values, indices = (KERNELS if on else TORCH).row_max(x.to(dtype))
        assert len(calls) == expected_calls
        assert torch.equal(indices, ref_indices) and values.isnan().tolist() == [False, False, True, False]
