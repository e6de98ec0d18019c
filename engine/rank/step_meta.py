"""A step's index tensors on the GPU, built once per step and read by every layer.

`StepMeta` holds, for every single-token item of a step, its token row, state slot, context
length and block table, so that the DeltaNet and attention layers run all decode items in one
kernel each; and for the prompt chunks their packed token rows and `PackedSpans` (slots and
cu_seqlens) for the chunked DeltaNet kernel. A layer given a plain StepBatch builds its own
(correct, but one host-to-device copy per layer: each waits for the stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.engine.rank.batch import SeqSpan, StepBatch
from deltaserve.kernels.gated_delta import PackedSpans


@dataclass(frozen=True, slots=True)
class StepMeta:
    """Decode items (one token each) first, then the prompt chunks' packing."""

    rows: torch.Tensor  # [D] int32, flat token index of each decode span
    slots: torch.Tensor  # [D] int32, its DeltaNet state slot (-1: padding)
    seq_lens: torch.Tensor  # [D] int32, positions it attends to, its own included (0: padding)
    block_tables: torch.Tensor  # [D, max_blocks] int64, its KV blocks (padded with block 0)
    max_seq_len: int  # host-side bound on seq_lens: sizes the attention grid
    prefill: tuple[SeqSpan, ...]  # the step's spans of more than one token
    prefill_rows: torch.Tensor | None = None  # [P] int64, their token rows, packed (only beside decodes)
    packed: PackedSpans | None = None  # their slots and lengths for the chunked kernel
    prefill_index: torch.Tensor | None = None  # [3, P] int32: each one's token offset, length, slot
    prefill_max_len: int = 0  # host-side bound on their lengths: sizes the conv's grid

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
    prefill_rows = packed = prefill_index = None
    if prefill:
        if decodes:  # prompt rows are packed apart only when decode rows sit among them
            rows = [r for s in prefill for r in range(s.offset, s.offset + s.length)]
            prefill_rows = torch.tensor(rows, dtype=torch.int64).to(device)
        packed = PackedSpans.build([s.slot for s in prefill], [s.length for s in prefill], device)
        columns = zip(*[(s.offset, s.length, s.slot) for s in prefill], strict=True)
        prefill_index = torch.tensor(list(columns), dtype=torch.int32).to(device)
    return StepMeta(
        rows=dev[0],
        slots=dev[1],
        seq_lens=dev[2],
        block_tables=_stacked_tables([s.block_table for s in decodes], width, device),
        max_seq_len=max((s.start + 1 for s in decodes), default=1),
        prefill=prefill,
        prefill_rows=prefill_rows,
        packed=packed,
        prefill_index=prefill_index,
        prefill_max_len=max((s.length for s in prefill), default=0),
    )


def with_step_meta(batch: StepBatch, device: torch.device) -> GpuStepBatch:
    """The executor's one call per step on CUDA: the same batch, plus its StepMeta."""
    return GpuStepBatch(
        input_ids=batch.input_ids,
        positions=batch.positions,
        kv_index=batch.kv_index,
        spans=batch.spans,
        logits_index=batch.logits_index,
        meta=build_step_meta(batch.spans, device),
    )


def step_meta_of(batch: StepBatch, device: torch.device) -> StepMeta:
    """The batch's StepMeta, or one built now (a plain StepBatch)."""
    if isinstance(batch, GpuStepBatch) and batch.meta is not None:
        return batch.meta
    return build_step_meta(batch.spans, device)
