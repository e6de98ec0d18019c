"""The Qwen3.5 vision tower (`model.visual.*` of the released checkpoints): patch embedding,
learned position embeddings resampled to each image's grid, rotary (2-D) attention blocks,
and the patch merger into the language model's hidden size. transformers'
`Qwen3_5VisionModel` is the reference; module names are the checkpoint's.

Attention runs over each frame's patches only (varlen: flash's kernel on the GPU, equal-length
frames batched through SDPA elsewhere), so the images of many requests encode in one forward.

Replicated on every tensor-parallel rank (each rank runs the whole tower on the same inputs,
no collective): the 4B model's tower is 0.3 B parameters against 4 B, and sharding it would
add two all-reduces of [patches, hidden] per block (48 for the 4B tower) to save at most
half of a few milliseconds of GEMMs per image; replication keeps its output the same on every
rank by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.rank.checkpoint_reader import CheckpointReader, SafetensorsError
from deltaserve.engine.rank.fp8 import Fp8Pairs
from deltaserve.engine.vision_config import VisionConfig
from deltaserve.kernels.paged_attention import flash_takes

VISUAL_PREFIX = "model.visual."
LAYER_NORM_EPS = 1e-6


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype, device=device)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype, device=device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: FrameBounds
    ) -> torch.Tensor:
        # x [N, hidden]; cos/sin [N, 1, head_dim] fp32
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # [N, heads, hd] each
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        return self.proj(frames.attend(q, k, v).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.linear_fc1 = nn.Linear(hidden, inter, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(inter, hidden, dtype=dtype, device=device)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.norm1 = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS, dtype=dtype, device=device)
        self.norm2 = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS, dtype=dtype, device=device)
        self.attn = VisionAttention(config, dtype, device)
        self.mlp = VisionMLP(config, dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: FrameBounds
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each 2x2 block of patches (adjacent rows in the processor's
    order) as one row through a GELU MLP into the language model's hidden size."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.merged = config.hidden_size * config.merge_unit
        self.norm = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS, dtype=dtype, device=device)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(self.merged, config.out_hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class FrameBounds:
    """Where each frame's patches lie in a tower batch: attention stays inside a frame."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.lengths = lengths
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        self.bounds = torch.tensor(bounds, dtype=torch.int32, device=device)
        self.max_len = max(lengths)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Non-causal attention of every frame over its own patches; [N, heads, hd]."""
        scale = q.shape[-1] ** -0.5
        if flash_takes(q.device, q.dtype, q.shape[-1]):
            bounds, longest = self.bounds, self.max_len
            # (q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, return_debug_mask)
            return torch.ops.aten._flash_attention_forward(
                q, k, v, bounds, bounds, longest, longest, 0.0, False, False, scale=scale
            )[0]
        out = torch.empty_like(q)
        starts: dict[int, list[int]] = {}  # frames of one length run as one SDPA batch
        at = 0
        for length in self.lengths:
            starts.setdefault(length, []).append(at)
            at += length
        for length, firsts in starts.items():
            index = (torch.tensor(firsts)[:, None] + torch.arange(length)).to(q.device)
            qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))  # [B, heads, L, hd]
            attended = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
            out[index] = attended.transpose(1, 2)
        return out


class VisionTower(nn.Module):
    """`model.visual`: pixels of several images (patches in the processor's order, end to end)
    to the language model's embeddings of their tokens, [sum of t*h*w / merge_unit, out_hidden]."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        # the checkpoint's Conv3d with stride = kernel: one matrix product per patch
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(
            config.in_channels,
            hidden,
            (config.temporal_patch_size, config.patch_size, config.patch_size),
            stride=(config.temporal_patch_size, config.patch_size, config.patch_size),
            dtype=dtype,
            device=device,
        )
        self.pos_embed = nn.Embedding(
            config.num_position_embeddings, hidden, dtype=dtype, device=device
        )
        self.blocks = nn.ModuleList(VisionBlock(config, dtype, device) for _ in range(config.depth))
        self.merger = PatchMerger(config, dtype, device)
        quarter = config.head_dim // 2  # each of height and width turns half the head dims
        self.inv_freq = 1.0 / (
            config.rope_theta
            ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=device) / quarter)
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """`pixels` [patches, patch_dim] of the images whose patch grids (t, h, w) are `grids`,
        in order; returns their token embeddings, in order."""
        weight = self.patch_embed.proj.weight
        x = (
            pixels.to(weight.dtype) @ weight.view(weight.shape[0], -1).T
            + self.patch_embed.proj.bias
        )
        x = x + self._position_embeddings(grids)
        cos, sin = self._rotary(grids)
        frames = FrameBounds([h * w for t, h, w in grids for _ in range(t)], x.device)
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.merger(x)

    def _merge_order(self, h: int, w: int) -> torch.Tensor:
        """[h*w] int64: raster indices of a frame's patches in the processor's order (2x2
        merge blocks row by row, each block's patches row by row)."""
        m = self.config.spatial_merge_size
        raster = torch.arange(h * w, device=self.inv_freq.device).view(h // m, m, w // m, m)
        return raster.transpose(1, 2).flatten()

    def _position_embeddings(self, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """The learned square grid resampled (bilinear, corners aligned) to each frame's grid."""
        side = self.config.grid_side
        table = self.pos_embed.weight.float().T.reshape(1, -1, side, side)
        parts = []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)
            frame = grid[0].flatten(1).T[self._merge_order(h, w)]  # [h*w, hidden]
            parts.append(frame.repeat(t, 1))
        return torch.cat(parts).to(self.dtype)

    def _rotary(self, grids: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, head_dim] fp32 of each patch's (row, column) rotation."""
        parts = []
        for t, h, w in grids:
            order = self._merge_order(h, w)
            rows, cols = order // w, order % w
            freqs = torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), -1)
            parts.append(freqs.repeat(t, 1))
        freqs = torch.cat(parts)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return angles.cos(), angles.sin()


def build_tower(
    model_dir: str | Path,
    config: VisionConfig,
    text: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> VisionTower:
    """The tower with the checkpoint's `model.visual.*` weights (FP8 ones widened, as the text
    model's are); a CheckpointError (from loader.py) names a missing or misshapen tensor."""
    from deltaserve.engine.rank.loader import CheckpointError, checkpoint_files

    if config.out_hidden_size != text.hidden_size:
        raise CheckpointError(
            f"vision_config.out_hidden_size {config.out_hidden_size} is not the text model's "
            f"hidden_size {text.hidden_size}"
        )
    tower = VisionTower(config, dtype, device)
    params = dict(tower.named_parameters())
    fp8 = Fp8Pairs(text.fp8_block, text.fp8_scale_suffix) if text.fp8_block else None
    loaded: set[str] = set()
    reader = CheckpointReader(device)
    for path in checkpoint_files(Path(model_dir)):
        try:
            for name, tensor in reader.tensors(path, lambda n: n.startswith(VISUAL_PREFIX)):
                if fp8 is not None and (taken := fp8.take(name, tensor)) is None:
                    continue
                name, tensor = taken if fp8 is not None else (name, tensor)
                target = name.removeprefix(VISUAL_PREFIX)
                param = params.get(target)
                if param is None or tuple(param.shape) != tuple(tensor.shape):
                    raise CheckpointError(
                        f"tensor {name!r} in {path.name}: "
                        + (
                            "not part of the vision tower"
                            if param is None
                            else f"shape {list(tensor.shape)}, not {list(param.shape)}"
                        )
                    )
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(target)
        except (SafetensorsError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{model_dir}: {e}") from None
    if missing := sorted(set(params) - loaded):
        raise CheckpointError(
            f"checkpoint {model_dir} lacks vision tensors: "
            + ", ".join(VISUAL_PREFIX + name for name in missing[:5])
        )
    return tower
