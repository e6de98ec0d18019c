"""Triton, when installed: the kernels of this package import `triton`, `tl` from here.

Triton is a GPU-only optional dependency (extra `gpu`). Without it the modules still import
(the `@triton.jit` bodies are never compiled) and every launch wrapper raises at once; the
CPU path never calls them. With TRITON_INTERPRET=1 the kernels run on CPU tensors through
Triton's interpreter (tests/test_kernels.py).
"""

from __future__ import annotations

import functools
import logging
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

# Programmatic dependent launch (Hopper on): a decode kernel's programs are launched while the
# kernel before it in the stream finishes, and wait in `wait_for_previous_grid` for its results,
# so the launch and ramp-up of one kernel hide behind the tail of the last. On the H200 the
# batch-1 decode step's replay fell from 2.93 to 2.72 ms (step_ab_h200_pdl_at_1b605c5.json; reading
# the first weight tile, or the slice to L2, before the wait measured no better, or worse; a GEMV
# program's whole rows, read into registers before the wait, pays for in_proj and gate_up:
# skinny_linear's TUNED). DELTASERVE_PDL=0 turns it off.
PDL = HAS_TRITON and os.environ.get("DELTASERVE_PDL", "1") != "0"
# Kernels launched with `reads_ahead` in this set load what no kernel before them in the step
# writes (slots, conv windows, positions: `read_ahead`) before the wait, and wait at GDC_LATE
# instead (tools/bench_step_ab.py's "late" modes take names out).
READ_AHEAD = frozenset({"conv", "attention"})
# Which kernels let the next one launch (`gdc_launch_dependents`) before their wait, not after
# it: the projections' ("gemv", "dot") and, on one row, every kernel ("one row"). The next
# kernel's programs then come resident (a whole-row GEMV's reading its weights) while this
# one still waits on the kernel before it. Safe either way: a kernel's wait returns only once
# the kernel before it has finished, which it does only after its own wait, so every kernel
# before it has finished too. Replay, H200: the 4B 0.3-0.8% faster at 1-64 rows, the 9B
# 0.2-0.7% (step_ab_h200_early_trigger_{4b,9b}_at_c868336.json). Every kernel early at 2-32
# rows cost 2-8% (step_ab_h200_early_trigger_kinds_4b_at_321a6ca.json), most likely as the
# programs of a tensor-core kernel placed while the one before it still runs share SMs that
# its one-wave K split counts on having to itself.
EARLY_TRIGGER = frozenset({"gemv", "dot", "one row"})
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no Triton, or one without griddepcontrol
    PDL = False
# Rows per program of the kernels that take several under Triton's interpreter (the norms):
# its cost is per program and per operation, not per element, and the CPU tests of the GPU
# path run thousands of norm rows. The GPU runs one row per program.
INTERPRETER_ROWS = 32


def rows_per_program() -> int:
    return INTERPRETER_ROWS if INTERPRET else 1


# Tests set this under TRITON_INTERPRET=1 to run the model's GPU code path, Triton kernels
# included, on CPU tensors: CI then covers that path's logic without a GPU.
GPU_PATH_ON_CPU = False


def gpu_path(t: torch.Tensor) -> bool:
    """Whether work on `t` takes the GPU code path (kernels, per-step StepMeta)."""
    return t.is_cuda or (GPU_PATH_ON_CPU and INTERPRET)


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


@functools.cache
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


H200_SMS = 132


@functools.cache
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(t: torch.Tensor) -> int:
    """The SMs of `t`'s GPU, which the one-wave launch rules fill; off CUDA (the GPU path under
    the interpreter) the H200's, where those rules were measured."""
    if not t.is_cuda:
        return H200_SMS
    return _sms(_device_index(t))


def pdl_options(t: torch.Tensor, reads_ahead: str | None = None, kind: str = "other") -> dict:
    """Launch options of a kernel that starts with `wait_for_previous_grid(GDC)`: PDL where the
    device has it, else none. `reads_ahead` (a name in READ_AHEAD): the kernel also takes
    GDC_LATE and waits there instead, after its `read_ahead` loads. `kind`: see EARLY_TRIGGER."""
    if PDL and t.is_cuda and _has_pdl(_device_index(t)):
        gdc = 2 if kind in EARLY_TRIGGER or ("one row" in EARLY_TRIGGER and t.shape[0] == 1) else 1
        if reads_ahead in READ_AHEAD:
            return {"GDC": 0, "GDC_LATE": gdc, "launch_pdl": True}
        return {"GDC": gdc, "launch_pdl": True}
    return {}


@triton.jit
def wait_for_previous_grid(GDC: tl.constexpr):
    """With GDC (launched by `pdl_options`): wait until the previous kernel in the stream has
    finished and its writes are visible, then let the next kernel launch. A kernel calls it
    before any load or store: a buffer it writes may be one the previous kernel still reads.
    GDC 2: let the next kernel launch first, then wait (`EARLY_TRIGGER`)."""
    if GDC == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif GDC:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def read_ahead(ptrs, mask=None, other=None):
    """A load that may come before `wait_for_previous_grid`: of memory no kernel of the step
    writes before this one (a weight; an index array of the step, made before its first
    kernel; the state of a slot that only this kernel writes in the step, as the conv window
    of a decoding request). It races nothing, and its latency hides behind the previous
    kernel's tail instead of following the wait."""
    return tl.load(ptrs, mask=mask, other=other)


def report_late_compiles(log: logging.Logger, rank: int) -> None:
    """From now on, log each Triton kernel specialization first used in this process: called
    once start-up (graph capture, warm-up) is done, every line names a shape the warm-up
    missed, which on a machine with an empty Triton cache is compiled while a request waits.
    Triton specializes on each int argument being 1 or a multiple of 16 and on each pointer's
    16-byte alignment; the line lists those, so the argument that varied shows."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        return

    def hook(*, fn, compile, **_kwargs) -> None:
        log.warning(
            "rank %d: Triton kernel %s first used after start-up: %s",
            rank,
            fn.name,
            _specialization(fn, compile),
        )

    knobs.runtime.jit_post_compile_hook = hook


def _specialization(fn, compile: dict) -> str:
    """`compile`'s attributes by argument name (their layout differs between Triton versions)."""
    try:
        names = [p.name for p in fn.jit_function.params]

        def name(path) -> str:
            return names[path[0]] if isinstance(path, tuple) else str(path)

        attrs = compile["configs"][0]
        marked = sorted(name(path) for path, kinds in attrs.items() if kinds)
        constants = {name(path): value for path, value in compile["constants"].items()}
        return f"16-aligned or divisible: {marked}; constants: {constants}"
    except Exception as exc:  # a Triton whose layout this does not know: say so, never fail
        return f"(attributes not readable: {type(exc).__name__})"


def check_launchable(*tensors) -> None:
    """Raise unless Triton can run on these tensors: CUDA, or CPU under the interpreter."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: install deltaserve[gpu] for the GPU kernels")
    for t in tensors:
        if not (t.is_cuda or INTERPRET):
            raise ValueError(
                f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {t.device}"
            )


def check_rows(name: str, t, width: int) -> None:
    """`t` is 2-D with `width` columns, the last dim contiguous (rows may be strided)."""
    if t.dim() != 2 or t.shape[1] != width or t.stride(1) != 1:
        raise ValueError(
            f"{name}: expected [rows, {width}] with a contiguous last dim, got shape "
            f"{tuple(t.shape)} strides {t.stride()}"
        )


def check_vector(name: str, t, length: int | None, dtypes: tuple = ()) -> None:
    """`t` is 1-D, of `length` elements (any number if None) and one of `dtypes` (if given),
    its elements adjacent: the kernels read element i at ptr + i, so a strided view (t[::2], a
    column) would be misread, or written past its end."""
    ok_shape = t.dim() == 1 and (length is None or t.shape[0] == length)
    if not ok_shape or (t.numel() > 1 and t.stride(0) != 1) or (dtypes and t.dtype not in dtypes):
        kinds = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"{name}: expected [{'n' if length is None else length}] {kinds} with adjacent "
            f"elements, got {tuple(t.shape)} {t.dtype} strides {t.stride()}"
        )


def check_index(name: str, t, length: int) -> None:
    check_vector(name, t, length, (torch.int32, torch.int64))
