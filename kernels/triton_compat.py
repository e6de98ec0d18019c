"""Triton, when installed: the kernels of this package import `triton`, `tl` from here.

Triton is a GPU-only optional dependency (extra `gpu`). Without it the modules still import
(the `@triton.jit` bodies are never compiled) and every launch wrapper raises at once; the
CPU path never calls them. With TRITON_INTERPRET=1 the kernels run on CPU tensors through
Triton's interpreter (tests/test_kernels.py).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install
    HAS_TRITON = False

    class _NoTriton:
        """Stands in for `triton` so that `@triton.jit` definitions import."""

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, int(n) - 1).bit_length()

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    triton = _NoTriton()
    tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tests set this under TRITON_INTERPRET=1 to run the model's GPU code path, Triton kernels
# included, on CPU tensors: CI then covers that path's logic without a GPU.
GPU_PATH_ON_CPU = False


def gpu_path(t: torch.Tensor) -> bool:
    """Whether work on `t` takes the GPU code path (kernels, per-step StepMeta)."""
    return t.is_cuda or (GPU_PATH_ON_CPU and INTERPRET)


def check_launchable(*tensors) -> None:
    """Raise unless Triton can run on these tensors: CUDA, or CPU under the interpreter."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: install deltaserve[gpu] for the GPU kernels")
    for t in tensors:
        if not (t.is_cuda or INTERPRET):
            raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {t.device}")


def check_rows(name: str, t, width: int) -> None:
    """`t` is 2-D with `width` columns, the last dim contiguous (rows may be strided)."""
    if t.dim() != 2 or t.shape[1] != width or t.stride(1) != 1:
        raise ValueError(
            f"{name}: expected [rows, {width}] with a contiguous last dim, got shape "
            f"{tuple(t.shape)} strides {t.stride()}"
        )


def check_index(name: str, t, length: int) -> None:
    if t.dim() != 1 or t.shape[0] != length or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected [{length}] int32/int64, got {tuple(t.shape)} {t.dtype}")

