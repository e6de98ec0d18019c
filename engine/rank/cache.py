"""A rank's request state: paged KV for the full-attention layers and one DeltaNet state slot
per live request (conv window + recurrent state for every DeltaNet layer; the recurrent state
fp32, or bf16 with --mamba-ssm-cache-dtype bfloat16: half the bytes a decode step moves), and
the saved prefix states of the prefix cache (engine/prefix_cache.py) after them.

The KV cache may be FP8 (--kv-cache-dtype fp8, kernels/kv_quant.py): then `kv_scale` holds
each full-attention layer's key and value scale per KV head, 1.0 until the first prompt step
calibrates them (--calculate-kv-scales: `calibrating` is set for that one eager step).

Holds only this rank's heads. Who owns which slot and blocks is the executor's business; this
class owns the memory, the free lists and the blocks' reference counts (a saved prefix shares
its request's full blocks; a block is free once nothing refers to it).
"""

from __future__ import annotations

import torch

from deltaserve.engine.model_config import ModelConfig
from deltaserve.kernels.kv_quant import FP8, K_SCALE_RANGE, V_SCALE_RANGE, calibrated_scale


def cache_shapes(
    config: ModelConfig,
    num_slots: int,
    num_blocks: int,
    block_size: int,
    tp_size: int,
    mtp: bool = False,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Shapes of a rank's request state (its share of the heads), for `StateCache` and the
    memory budget alike (`num_slots` counting the prefix states):
    KV [layer, k|v, block * block_size + offset, head, head_dim] (model dtype, or FP8), the
    MTP head's layer last (`mtp`: speculative decoding, engine/rank/mtp.py);
    conv [layer, slot, channel, width - 1], the last pre-conv inputs (model dtype);
    recurrent [layer, slot, value head, dk, dv] (the state dtype)."""
    n_full = len(config.full_attention_layers) + mtp
    n_linear = len(config.linear_attention_layers)
    kv = (
        n_full,
        2,
        num_blocks * block_size,
        config.num_key_value_heads // tp_size,
        config.head_dim,
    )
    conv = (
        n_linear,
        num_slots,
        config.linear_conv_dim // tp_size,
        config.linear_conv_kernel_dim - 1,
    )
    recurrent = (
        n_linear,
        num_slots,
        config.linear_num_value_heads // tp_size,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
    )
    return kv, conv, recurrent


class StateCache:
    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        tp_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_prefix_states: int = 0,
        state_dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,  # None: the model's
        mtp: bool = False,
    ) -> None:
        if num_slots < 1 or num_blocks < 1 or block_size < 1 or num_prefix_states < 0:
            raise ValueError(
                "cache needs num_slots, num_blocks, block_size >= 1 and num_prefix_states >= 0, "
                f"got {num_slots}, {num_blocks}, {block_size}, {num_prefix_states}"
            )
        self.num_slots = num_slots  # request slots; prefix state e is slot num_slots + e
        self.num_prefix_states = num_prefix_states
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_heads = config.num_key_value_heads // tp_size
        self.state_heads = config.linear_num_value_heads // tp_size
        kv, conv, recurrent = cache_shapes(
            config, num_slots + num_prefix_states, num_blocks, block_size, tp_size, mtp
        )
        self.kv = torch.zeros(kv, dtype=kv_dtype or dtype, device=device)
        # [layer, k|v, head] of an FP8 cache: what each stored key or value was divided by
        self.kv_scale = torch.ones((kv[0], 2, kv[3]), dtype=torch.float32, device=device)
        self.calibrating = False  # the step running sets the scales from its keys and values
        self.conv = torch.zeros(conv, dtype=dtype, device=device)
        self.recurrent = torch.zeros(recurrent, dtype=state_dtype, device=device)
        # each slot's last sample, the input of a decode item sent without its token (a
        # pipelined step): rank 0's sampler writes it on the device, so the next step need not
        # wait for the host to read it; other ranks get it by broadcast when a step needs it
        self.last_tokens = torch.zeros(num_slots, dtype=torch.int64, device=device)
        # with an MTP head: each slot's final hidden state at its last position, which the
        # head reads with the next token (engine/rank/mtp.py); a spare last row takes the
        # writes of padding rows (slot -1)
        self.hidden = (
            torch.zeros(
                (num_slots + num_prefix_states + 1, config.hidden_size), dtype=dtype, device=device
            )
            if mtp
            else None
        )
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks  # holders of each block: requests and saved prefixes

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int, num_shared: int = 0) -> bool:
        return self.free_slots >= 1 and self.free_blocks >= self.blocks_for(num_tokens) - num_shared

    def allocate(self, num_tokens: int, shared: list[int] = ()) -> tuple[int, list[int]]:
        """Take a zeroed state slot and the KV blocks for `num_tokens` positions: `shared`
        (a saved prefix's full blocks, held once more) first, then free ones."""
        if not self.can_allocate(num_tokens, len(shared)):
            raise MemoryError(
                f"no room for {num_tokens} tokens: {self.free_slots} free slots, "
                f"{self.free_blocks} free blocks of {self.block_size}"
            )
        slot = self._free_slots.pop()
        self.hold(shared)
        blocks = list(shared) + self.take_blocks(self.blocks_for(num_tokens) - len(shared))
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        return slot, blocks

    def take_blocks(self, num_blocks: int) -> list[int]:
        """Hold `num_blocks` free blocks (a request's growth, or its first ones)."""
        if num_blocks > self.free_blocks:
            raise MemoryError(f"{num_blocks} blocks asked, {self.free_blocks} free")
        blocks = [self._free_blocks.pop() for _ in range(num_blocks)]
        self.hold(blocks)
        return blocks

    def free(self, slot: int, blocks: list[int]) -> None:
        self._free_slots.append(slot)
        self.release(blocks)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def hold(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free_blocks.append(b)

    def layer_kv_scale(self, layer: int) -> torch.Tensor | None:
        """Full-attention layer `layer`'s [2, heads] scales, or None: not an FP8 cache."""
        return self.kv_scale[layer] if self.kv.dtype == FP8 else None

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A layer's scales from its keys and values [T, heads, hd] of this step."""
        self.kv_scale[layer, 0] = calibrated_scale(k, K_SCALE_RANGE)
        self.kv_scale[layer, 1] = calibrated_scale(v, V_SCALE_RANGE)

    def copy_state(self, src: int, dst: int) -> None:
        """Slot `dst`'s DeltaNet state (conv window, recurrent state, every layer) := `src`'s,
        and its last hidden state (MTP)."""
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]
        if self.hidden is not None:
            self.hidden[dst] = self.hidden[src]

    def copy_block(self, src: int, dst: int) -> None:
        """Block `dst`'s keys and values (every full-attention layer) := `src`'s."""
        bs = self.block_size
        self.kv[:, :, dst * bs : (dst + 1) * bs] = self.kv[:, :, src * bs : (src + 1) * bs]
