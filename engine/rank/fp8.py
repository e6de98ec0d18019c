"""FP8 checkpoints: Qwen's `-FP8` releases (DeepSeek-V3's format) and llm-compressor's
compressed-tensors FP8 (vLLM's usual FP8 checkpoints).

Each quantized projection is stored as an FP8 `weight` of [rows, cols] beside fp32 scales of
[ceil(rows / bm), ceil(cols / bn)] for blocks of [bm, bn]: the real weight is the FP8 value
times its block's scale. Qwen's name them `weight_scale_inv` (the inverse of the quantizer's
scale) with `weight_block_size` [bm, bn]; compressed-tensors' `weight_scale`, one per block,
output row ("channel": [1, cols]) or tensor ([rows, cols]; a block side of 0 here means the
whole dimension).
Every other tensor (embeddings, norms, conv, whichever `modules_to_not_convert` names) is a
plain float tensor. Which tensors are quantized is read from the tensors' dtypes, not from
that list, so a release that quantizes more or fewer projections loads the same way.

The weights are widened as they load (to fp32, then the model's dtype), as transformers
does on a machine without FP8 kernels: the model runs as a bf16 or fp32 checkpoint would.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.fp8_scales import FP8_DTYPES, dequantize


class Fp8Pairs:
    """Pairs each FP8 weight with its scales as a checkpoint's tensors arrive (in file order,
    a pair possibly split across two shard files) and hands out the widened weight."""

    def __init__(self, block: tuple[int, int], scale_suffix: str) -> None:
        self.block, self.suffix = block, scale_suffix
        self.weights: dict[str, torch.Tensor] = {}  # weight name -> FP8 values awaiting scales
        self.scales: dict[str, torch.Tensor] = {}  # weight name -> scales awaiting the values

    def take(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """(name, tensor) to load now: a plain tensor as it came, an FP8 weight widened once
        both halves are here; None while one half waits. ValueError for a malformed pair."""
        if name.endswith(self.suffix):
            weight_name = name.removesuffix(self.suffix)
            if not tensor.dtype.is_floating_point or tensor.dtype in FP8_DTYPES:
                raise ValueError(
                    f"{name} has dtype {str(tensor.dtype).removeprefix('torch.')}, not fp32 scales"
                )
            self.scales[weight_name] = tensor
        elif tensor.dtype in FP8_DTYPES:
            weight_name = name
            self.weights[name] = tensor
        else:
            return name, tensor
        if weight_name not in self.weights or weight_name not in self.scales:
            return None
        weight, scales = self.weights.pop(weight_name), self.scales.pop(weight_name)
        try:
            return weight_name, dequantize(weight, scales, self.block)
        except ValueError as e:
            raise ValueError(f"FP8 weight {weight_name}: {e}") from None

    def unpaired(self) -> list[str]:
        """What is left once every file is read: FP8 weights without scales, scales without
        an FP8 weight (a plain weight's, or none)."""
        return [f"{name} (FP8, no {self.suffix})" for name in sorted(self.weights)] + [
            f"{name}{self.suffix} (no FP8 weight)" for name in sorted(self.scales)
        ]
