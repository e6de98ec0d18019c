"""What the kernel tests share: NaN-poisoned outputs, error bounds, the CUDA marks.

Imported as `kernel_checks` (pytest puts tests/ on sys.path; tests/ has no __init__.py).
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# relative L2 error bounds: fp32 kernels reorder sums only; bf16 outputs differ by rounding
# (the interpreter also truncates where the GPU rounds to nearest)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not torch.isnan(got).any(), f"{what}: NaN left (an element the kernel did not write)"
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()
    assert err <= TOLERANCE[dtype], f"{what}: relative error {err:.2e} > {TOLERANCE[dtype]:.0e}"


def pick(n: int, k: int, device) -> torch.Tensor:
    """k distinct indices of range(n), in random order, int32."""
    return torch.randperm(n)[:k].to(device=device, dtype=torch.int32)
