"""A step's index tensors on the GPU, built once per step and read by every layer.

`StepMeta` holds, for every single-token item of a step, its token row, state slot, context
length and block table, so that the DeltaNet and attention layers run all decode items in one
kernel each; and for the prompt chunks their packed token rows and `PackedSpans` (rows,
lengths, slots, cu_seqlens and the 64-token block table of the conv and the chunked DeltaNet
kernel). A layer given a plain StepBatch builds its own (correct, but one host-to-device copy
per layer: each waits for the stream). A prompt CUDA graph (prompt_graphs.py) holds the same
fields as views of its static buffers, padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.engine.rank.batch import SeqSpan, StepBatch
from deltaserve.kernels.causal_conv1d import span_blocks
from deltaserve.kernels.gated_delta import CHUNK_SIZE
from deltaserve.kernels.paged_attention import KeyBlocks


@dataclass(frozen=True, slots=True)
class PackedSpans:
    """The prompt chunks of a step, for the kernels that take them all at once (the DeltaNet
    conv and chunked forward, flash's varlen attention). Every grid they launch is fixed by
    these tensors' sizes and `max_len`, so a prompt CUDA graph captures them over padded
    buffers: empty spans of slot -1 after the real ones, block-table entries naming one."""

    # [3, n] int32: each chunk's first token row in the step, its length, its slot. A row
    # starts 4n bytes on, 16-byte aligned or not by n: kernels reading them must not
    # specialize on alignment (`do_not_specialize_on_alignment`), or each n % 4 compiles anew
    index: torch.Tensor
    # [n + 1] int32: cumulative lengths over the packed prompt rows (cu_seqlens)
    bounds: torch.Tensor
    blocks: torch.Tensor  # [entries, 2] int32: (chunk, CHUNK_SIZE-token block), `span_blocks`
    max_len: int  # host-side bound on the lengths: sizes flash's grid
    fresh: bool  # every chunk is its prompt's first: attention reads no cached keys
    # the blocks attention gathers its keys from (a prompt graph of an engine with prefix
    # caching, whose chunks may follow cached positions); None: `fresh` decides
    keys: KeyBlocks | None = None
    # [n] int32 where each chunk's final DeltaNet state goes: -1 for speculative decoding's
    # verify spans (engine/rank/speculative.py); None: its slot
    store_slots: torch.Tensor | None = None

    @classmethod
    def build(cls, spans: tuple[SeqSpan, ...], device: torch.device) -> PackedSpans:
        lengths = [s.length for s in spans]
        host = torch.tensor(
            [[s.offset for s in spans], lengths, [s.slot for s in spans]], dtype=torch.int32
        )
        bounds = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        blocks = torch.tensor(span_blocks(lengths, CHUNK_SIZE), dtype=torch.int32).reshape(-1, 2)
        store = None
        if any(s.verify for s in spans):
            store = torch.tensor([-1 if s.verify else s.slot for s in spans], dtype=torch.int32)
        return cls(
            index=host.to(device),
            bounds=bounds.to(device),
            blocks=blocks.to(device),
            max_len=max(lengths, default=0),
            fresh=all(s.start == 0 for s in spans),
            store_slots=None if store is None else store.to(device),
        )


@dataclass(frozen=True, slots=True)
class StepMeta:
    """Decode items (one token each) first, then the prompt chunks' packing."""

    rows: torch.Tensor  # [D] int32, flat token index of each decode span
    slots: torch.Tensor  # [D] int32, its DeltaNet state slot (-1: padding)
    seq_lens: torch.Tensor  # [D] int32, positions it attends to, its own included (0: padding)
    block_tables: torch.Tensor  # [D, max_blocks] int64, its KV blocks (padded with block 0)
    max_seq_len: int  # host-side bound on seq_lens: sizes the attention grid
    prefill: tuple[SeqSpan, ...]  # the step's spans of more than one token
    # [P] int64, their token rows, packed (only beside decodes)
    prefill_rows: torch.Tensor | None = None
    packed: PackedSpans | None = None  # them, for the kernels that take them all at once
    # a verify graph's (verify_graphs.py): every row attends as a decode row does, to its own
    # position, [rows int32 | context lengths int32 | block tables int64 [rows, max_blocks]],
    # while the DeltaNet layers take the spans `packed`
    attend_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_decodes(self) -> int:
        return int(self.rows.shape[0])


@dataclass(frozen=True, slots=True)
class GpuStepBatch(StepBatch):
    """A StepBatch that carries its StepMeta, built once for all layers."""

    meta: StepMeta | None = None


def _stacked_tables(tables: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    """[len(tables), width] int64, rows padded with block 0: one cat, one small host-to-device
    copy and one gather, not one copy per request."""
    if not tables:
        return torch.zeros((0, width), dtype=torch.int64, device=device)
    flat = torch.cat([t.to(device=device, dtype=torch.int64) for t in tables])
    lengths = torch.tensor([int(t.shape[0]) for t in tables], dtype=torch.int64)
    cols = torch.arange(width, dtype=torch.int64)[None, :]
    index = torch.where(cols < lengths[:, None], (lengths.cumsum(0) - lengths)[:, None] + cols, -1)
    index = index.to(device)
    return flat[index.clamp(min=0)].masked_fill_(index < 0, 0)


def build_step_meta(spans: tuple[SeqSpan, ...], device: torch.device) -> StepMeta:
    decodes = [s for s in spans if s.length == 1]
    host = torch.tensor(
        [[s.offset for s in decodes], [s.slot for s in decodes], [s.start + 1 for s in decodes]],
        dtype=torch.int32,
    ).reshape(3, len(decodes))
    dev = host.to(device)
    width = max((int(s.block_table.shape[0]) for s in decodes), default=1)
    prefill = tuple(s for s in spans if s.length > 1)
    prefill_rows = packed = None
    if prefill:
        if decodes:  # prompt rows are packed apart only when decode rows sit among them
            rows = [r for s in prefill for r in range(s.offset, s.offset + s.length)]
            prefill_rows = torch.tensor(rows, dtype=torch.int64).to(device)
        packed = PackedSpans.build(prefill, device)
    return StepMeta(
        rows=dev[0],
        slots=dev[1],
        seq_lens=dev[2],
        block_tables=_stacked_tables([s.block_table for s in decodes], width, device),
        max_seq_len=max((s.start + 1 for s in decodes), default=1),
        prefill=prefill,
        prefill_rows=prefill_rows,
        packed=packed,
    )


def with_step_meta(batch: StepBatch, device: torch.device) -> GpuStepBatch:
    """The executor's one call per step on CUDA: the same batch, plus its StepMeta."""
    return GpuStepBatch(
        input_ids=batch.input_ids,
        positions=batch.positions,
        kv_index=batch.kv_index,
        spans=batch.spans,
        logits_index=batch.logits_index,
        token_slots=batch.token_slots,
        vision=batch.vision,
        mtp=batch.mtp,
        stash=batch.stash,
        meta=build_step_meta(batch.spans, device),
    )


def step_meta_of(batch: StepBatch, device: torch.device) -> StepMeta:
    """The batch's StepMeta, or one built now (a plain StepBatch)."""
    if isinstance(batch, GpuStepBatch) and batch.meta is not None:
        return batch.meta
    return build_step_meta(batch.spans, device)
