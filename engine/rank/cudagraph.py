"""The GPU decode step: the device index tensors of a step's decode items, and CUDA graphs of
decode-only steps.

`DecodeMeta` holds, for every single-token span of a step, its token row, state slot,
context length and block table as device tensors, so that the DeltaNet and attention layers
run all decode items in one kernel each. Build it once per step (`with_decode_meta`); a
layer given a plain StepBatch builds its own (correct, but one host-to-device copy per layer).

`DecodeGraphs` captures one CUDA graph per batch bucket (1, 2, 4, ... up to max_batch) of a
decode-only step and replays it: a step then costs a few copies into static buffers and one
launch instead of ~15 kernel launches per layer from Python. The idea is vLLM's and
nano-vllm's (`model_runner.capture_cudagraph`): static inputs, padding rows that touch
nothing (slot -1, KV row -1, context length 0), one memory pool shared by all buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deltaserve.engine.rank.batch import SeqSpan, StepBatch
from deltaserve.engine.rank.cache import StateCache
from deltaserve.kernels.gated_delta import PackedSpans


@dataclass(frozen=True, slots=True)
class DecodeMeta:
    rows: torch.Tensor  # [D] int32, flat token index of each decode span
    slots: torch.Tensor  # [D] int32, its DeltaNet state slot (-1: padding)
    seq_lens: torch.Tensor  # [D] int32, positions it attends to, its own included (0: padding)
    block_tables: torch.Tensor  # [D, max_blocks] int64, its KV blocks (padded with block 0)
    max_seq_len: int  # host-side bound on seq_lens: sizes the attention grid
    prefill: tuple[SeqSpan, ...]  # the step's spans of more than one token
    prefill_rows: torch.Tensor | None = None  # [P] int64, their token rows, packed in order
    packed: PackedSpans | None = None  # their slots and lengths for the chunked kernel

    @property
    def num_decodes(self) -> int:
        return int(self.rows.shape[0])


@dataclass(frozen=True, slots=True)
class GpuStepBatch(StepBatch):
    """A StepBatch that carries its DecodeMeta, built once for all layers."""

    decode: DecodeMeta | None = None


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


def build_decode_meta(spans: tuple[SeqSpan, ...], device: torch.device) -> DecodeMeta:
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
        rows = [r for s in prefill for r in range(s.offset, s.offset + s.length)]
        prefill_rows = torch.tensor(rows, dtype=torch.int64).to(device)
        packed = PackedSpans.build([s.slot for s in prefill], [s.length for s in prefill], device)
    return DecodeMeta(
        rows=dev[0],
        slots=dev[1],
        seq_lens=dev[2],
        block_tables=_stacked_tables([s.block_table for s in decodes], width, device),
        max_seq_len=max((s.start + 1 for s in decodes), default=1),
        prefill=prefill,
        prefill_rows=prefill_rows,
        packed=packed,
    )


def with_decode_meta(batch: StepBatch, device: torch.device) -> GpuStepBatch:
    """The executor's one call per step on CUDA: the same batch, plus its DecodeMeta."""
    return GpuStepBatch(
        input_ids=batch.input_ids,
        positions=batch.positions,
        kv_index=batch.kv_index,
        spans=batch.spans,
        logits_index=batch.logits_index,
        decode=build_decode_meta(batch.spans, device),
    )


def decode_meta_of(batch: StepBatch, device: torch.device) -> DecodeMeta:
    """The batch's DecodeMeta, or one built now (a plain StepBatch)."""
    if isinstance(batch, GpuStepBatch) and batch.decode is not None:
        return batch.decode
    return build_decode_meta(batch.spans, device)


def batch_buckets(max_batch: int) -> list[int]:
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return [*sizes, max_batch]


class DecodeGraphs:
    """One CUDA graph per batch bucket of single-token items over `model` and `cache`.

    A step's inputs are three rows of int64, [token | position | slot] per item (slot -1 pads
    a bucket), copied to the GPU in one transfer from a pinned buffer; everything else is
    computed inside the graph: the KV row from the slot's block table (kept on the GPU per
    slot, `set_table` at admission), the context length, the block tables of the batch. So a
    step costs Python one small copy and one launch.

    At TP > 1 every rank captures the same buckets in the same order at start-up and replays
    the same bucket each step (every rank runs every step), so the NCCL collectives inside
    (all-reduce after each row-parallel layer, the logits all-gather) pair up across ranks;
    the warm-up run before each capture creates the communicators.

    Off CUDA (the GPU path under Triton's interpreter, in tests) nothing is captured: `run`
    runs the model on the same static buffers eagerly, so CI covers their plumbing.
    """

    def __init__(
        self, model: nn.Module, cache: StateCache, max_batch: int, max_blocks: int
    ) -> None:
        if max_batch < 1 or max_blocks < 1:
            raise ValueError(f"max_batch and max_blocks must be >= 1, got {max_batch}, {max_blocks}")
        self.model = model
        self.cache = cache
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        device = cache.kv.device
        self.device = device
        self.is_cuda = device.type == "cuda"
        i64 = {"dtype": torch.int64, "device": device}
        self.inputs = torch.zeros((3, max_batch), **i64)  # token, position, slot
        self.inputs[2].fill_(-1)
        self.host = torch.zeros((3, max_batch), dtype=torch.int64, pin_memory=self.is_cuda)
        self.copied = torch.cuda.Event() if self.is_cuda else None  # host buffer free again
        self.slot_tables = torch.zeros((cache.num_slots, max_blocks), **i64)
        self.arange = torch.arange(max_batch, **i64)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.pool = None

    def set_table(self, slot: int, table: torch.Tensor) -> None:
        """The block table of the request now in `slot` (at most `max_blocks` blocks)."""
        self.slot_tables[slot].zero_()
        self.slot_tables[slot, : table.shape[0]].copy_(table)

    def _batch(self, size: int) -> GpuStepBatch:
        """The step over the first `size` rows of the static inputs, by tensor ops only (so a
        capture records them): padding rows (slot -1) write KV row -1 and read nothing."""
        tokens, positions, slots = self.inputs[:, :size]
        bs = self.cache.block_size
        valid = slots >= 0
        tables = self.slot_tables[slots.clamp(min=0)]  # [size, max_blocks]
        block = tables.gather(1, (positions // bs).clamp(max=self.max_blocks - 1)[:, None])[:, 0]
        rows = self.arange[:size]
        meta = DecodeMeta(
            rows=rows.to(torch.int32),
            slots=slots.to(torch.int32),
            seq_lens=torch.where(valid, positions + 1, 0).to(torch.int32),
            block_tables=tables,
            max_seq_len=self.max_blocks * bs,
            prefill=(),
        )
        return GpuStepBatch(
            input_ids=tokens,
            positions=positions,
            kv_index=torch.where(valid, block * bs + positions % bs, -1),
            spans=(),
            logits_index=rows,
            decode=meta,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (so smaller ones reuse its memory pool)."""
        for size in sorted(batch_buckets(self.max_batch), reverse=True):
            if not self.is_cuda:
                self.graphs[size] = (None, None)
                continue
            self.model(self._batch(size), self.cache)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.model(self._batch(size), self.cache)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = (graph, logits)
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def can_run(self, num_items: int, num_blocks: int) -> bool:
        """Whether `num_items` single-token items whose tables hold at most `num_blocks`
        blocks fit a captured bucket."""
        return bool(self.graphs) and 0 < num_items <= self.max_batch and num_blocks <= self.max_blocks

    @torch.inference_mode()
    def run(self, tokens: list[int], positions: list[int], slots: list[int], sampled: list[int]) -> torch.Tensor | None:
        """Replay the smallest bucket that holds the items (one `can_run`); fp32 logits of
        the rows `sampled` on rank 0, None on the others."""
        n = len(tokens)
        size = min(b for b in self.graphs if b >= n)
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy has read the pinned buffer
        self.host[:, :n] = torch.tensor([tokens, positions, slots], dtype=torch.int64)
        self.host[:2, n:size] = 0
        self.host[2, n:size] = -1
        self.inputs[:, :size].copy_(self.host[:, :size], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        graph, logits = self.graphs[size]
        if graph is None:  # not CUDA: the same buffers, run eagerly
            logits = self.model(self._batch(size), self.cache)
        else:
            graph.replay()
        if logits is None:
            return None
        # a copy: the graph's output buffer is overwritten by the next replay
        return logits[:n].clone() if len(sampled) == n else logits[torch.tensor(sampled, device=logits.device)]
