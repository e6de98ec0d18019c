"""An FP8 (e4m3) KV cache: keys and values stored as float8_e4m3fn, each divided by a scale of
its layer and KV head, multiplied back when read (vLLM's `--kv-cache-dtype fp8`, whose scales
are per tensor: every head of a layer then has the same one).

Plain torch here, for the CPU path and the prompt paths that gather cache rows; the GPU's
store (kernels/rope.py, `norm_rope`, through `e4m3_values`) and decode attention
(kernels/paged_attention.py) do the same inside their kernels. Scales come from the first
prompt step's keys and values (`--calculate-kv-scales`: vLLM's rule, the largest magnitude
over K_SCALE_RANGE or V_SCALE_RANGE, which leaves room for larger values later), else 1.0; a
checkpoint's own scales (`kv_cache_scheme`) are refused for now.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.triton_compat import tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: a calibrated scale maps the largest magnitude
# seen to this value, below FP8_MAX
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., heads, hd] / scale [heads], saturated to e4m3's range, as FP8."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 x [..., heads, hd] times scale [heads], in `dtype`."""
    return (x.float() * scale[:, None]).to(dtype)


def round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What reading x back from an FP8 cache gives: attention over fresh keys and values
    sees the same as over cached ones, so a prompt's output does not depend on its chunks."""
    return dequantize(quantize(x, scale), scale, x.dtype)


@triton.jit
def e4m3_values(x):
    """fp32 x, |x| <= FP8_MAX, rounded to the nearest e4m3 value (ties to even), still fp32:
    its cast to FP8 is then exact. On the GPU the cast rounds so by itself; Triton's
    interpreter (CI) drops a rounding's carry (1.97 -> 1.0), so the kernels round first."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # below 2^-6: subnormal spacing
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    y = tl.abs(x) / step
    low = tl.floor(y)
    odd = low - 2.0 * tl.floor(low * 0.5)
    up = (y - low > 0.5) | ((y - low == 0.5) & (odd == 1.0))
    return tl.where(x < 0, -1.0, 1.0) * (low + up.to(tl.float32)) * step


def calibrated_scale(x: torch.Tensor, value_range: float) -> torch.Tensor:
    """Per head: the largest magnitude of x [T, heads, hd] over `value_range` (1.0 where a
    head saw only zeros)."""
    amax = x.detach().abs().amax(dim=(0, 2)).float()
    return torch.where(amax > 0, amax / value_range, torch.ones_like(amax))
