"""A rank's request state: paged KV for the full-attention layers and one DeltaNet state slot
per live request (conv window + fp32 recurrent state for every DeltaNet layer), and the saved
prefix states of the prefix cache (engine/prefix_cache.py) after them.

Holds only this rank's heads. Who owns which slot and blocks is the executor's business; this
class owns the memory, the free lists and the blocks' reference counts (a saved prefix shares
its request's full blocks; a block is free once nothing refers to it).
"""

from __future__ import annotations

import torch

from deltaserve.engine.model_config import ModelConfig


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
    KV [layer, k|v, block * block_size + offset, head, head_dim] (model dtype), the MTP
    head's layer last (`mtp`: speculative decoding, engine/rank/mtp.py);
    conv [layer, slot, channel, width - 1], the last pre-conv inputs (model dtype);
    recurrent [layer, slot, value head, dk, dv] (fp32)."""
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
        mtp: bool = False,
    ) -> None:
        if num_slots < 1 or num_blocks < 1 or block_size < 1 or num_prefix_states < 0:
            raise ValueError(
                f"cache needs num_slots, num_blocks, block_size >= 1 and num_prefix_states >= 0, got "
                f"{num_slots}, {num_blocks}, {block_size}, {num_prefix_states}"
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
        self.kv = torch.zeros(kv, dtype=dtype, device=device)
        self.conv = torch.zeros(conv, dtype=dtype, device=device)
        self.recurrent = torch.zeros(
            recurrent, dtype=torch.float32, device=device
        )  # whatever the model dtype
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
        blocks = list(shared) + [
            self._free_blocks.pop() for _ in range(self.blocks_for(num_tokens) - len(shared))
        ]
        self.hold(blocks)
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        return slot, blocks

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
