"""CUDA graphs of the single-token items of a step (decode).

`DecodeGraphs` captures one CUDA graph per batch bucket (1, 2, 4, ... up to max_batch) and
replays it: a step then costs one small copy and one launch instead of ~15 kernel launches
per layer from Python. The idea is vLLM's and nano-vllm's (`model_runner.capture_cudagraph`):
static inputs, padding rows that touch nothing (slot -1, KV row -1, context length 0), one
memory pool shared by all buckets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deltaserve.engine.rank.batch import MtpRows
from deltaserve.engine.rank.cache import StateCache
from deltaserve.engine.rank.step_meta import GpuStepBatch, StepMeta
from deltaserve.engine.rank.transfer import to_device

WIDE_ROWS = 4  # a decode item's int64 inputs: token, position, KV row, the MTP head's KV row
NARROW_ROWS = 3  # its int32 inputs: slot, context length, block-table row
INPUT_BYTES_PER_ITEM = WIDE_ROWS * 8 + NARROW_ROWS * 4


def batch_buckets(max_batch: int) -> list[int]:
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return [*sizes, max_batch]


class BucketGraphs:
    """One CUDA graph of `model` over `cache` per bucket size, all in one memory pool (largest
    captured first, so smaller ones reuse its memory; no two ever replay at once), each over
    static inputs that the subclass's `_batch(size)` reads.

    Off CUDA (the GPU path under Triton's interpreter, in tests) nothing is captured: a replay
    runs the model on the same static buffers eagerly, so CI covers their plumbing.
    """

    def __init__(self, model: nn.Module, cache: StateCache) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.kv.device
        self.is_cuda = self.device.type == "cuda"
        # the pinned host buffer is free again
        self.copied = torch.cuda.Event() if self.is_cuda else None
        # per bucket: the graph, its final hidden states (every row, normed) and fp32 logits
        self.graphs: dict[
            int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None, torch.Tensor | None]
        ] = {}
        self.pool = None
        self.replays = 0  # steps run through a bucket (tests and benchmarks read it)

    def _batch(self, size: int) -> GpuStepBatch:
        raise NotImplementedError

    def _capture(
        self, sizes: list[int], prepare: Callable[[int], None] = lambda size: None
    ) -> None:
        """Capture each bucket of `sizes` after `prepare(size)` has set its inputs: a warm-up
        run (compiles kernels, settles allocations), then the captured one. Each builds its
        batch afresh: fla caches helpers by tensor identity, and a capture that hit the
        warm-up's entries would record no kernel for them."""
        for size in sorted(sizes, reverse=True):
            if not self.is_cuda:
                self.graphs[size] = (None, None, None)
                continue
            prepare(size)
            self._forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden, logits = self._forward(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = (graph, hidden, logits)
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def _upload(self, values: torch.Tensor, host: torch.Tensor, inputs: torch.Tensor) -> None:
        """inputs = values through `host`, a view of the pinned buffer, without waiting for
        the copy: the buffer is written again only once the last step's copy has read it."""
        if self.copied is not None:
            self.copied.synchronize()
        host.copy_(values)
        inputs.copy_(host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over bucket `size`: the final hidden states of every row (kept, so that
        prompt logprobs can be taken from them) and the fp32 logits (None off rank 0)."""
        batch = self._batch(size)
        hidden = self.model.hidden_states(batch, self.cache)
        return hidden, self.model.logits(hidden, batch)

    def _replay(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bucket `size` over the static inputs as they are now: its hidden states' and logits'
        buffers (logits None off rank 0), which the next replay overwrites."""
        graph, hidden, logits = self.graphs[size]
        self.replays += 1
        if graph is None:  # not CUDA: the same buffers, run eagerly
            return self._forward(size)
        graph.replay()
        return hidden, logits


class DecodeGraphs(BucketGraphs):
    """One CUDA graph per batch bucket of single-token items over `model` and `cache`.

    A step's inputs are made on the host, where they are a few integers per item, and copied
    to the GPU in one transfer from a pinned buffer: int64 rows [token | position | KV row |
    head KV row] and int32 rows [slot | context length | block-table row] (slot -1, KV rows
    -1 and length 0 pad a bucket; token -1 is the slot's last sample, `cache.last_tokens`,
    which the embedding kernel reads on the GPU). With an MTP head (engine/rank/mtp.py) the
    graph also runs the head's catch-up: each row's keys of the head at the position before
    (the head KV row, -1: none), from the slot's saved hidden state, which it then replaces.
    Inside the graph only the batch's block tables are gathered (one kernel) from the per-slot
    tables kept on the GPU (`set_table` at admission): index arithmetic in the graph cost a
    kernel per torch op, ~20 launches in a row before the first layer. So a step costs Python
    one small copy and one launch.

    At TP > 1 every rank captures the same buckets in the same order at start-up and replays
    the same bucket each step (every rank runs every step), so the NCCL collectives inside
    (all-reduce after each row-parallel layer, the logits all-gather) pair up across ranks;
    the warm-up run before each capture creates the communicators.

    """

    def __init__(
        self, model: nn.Module, cache: StateCache, max_batch: int, max_blocks: int
    ) -> None:
        if max_batch < 1 or max_blocks < 1:
            raise ValueError(
                f"max_batch and max_blocks must be >= 1, got {max_batch}, {max_blocks}"
            )
        super().__init__(model, cache)
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.width = -(-max_batch // 4) * 4  # items per row: every row starts 16-byte aligned
        # [token | position | KV row | head KV row] int64, then [slot | length | table row]
        # int32, padding's
        self.inputs = torch.zeros(
            INPUT_BYTES_PER_ITEM * self.width, dtype=torch.uint8, device=self.device
        )
        self.host = torch.zeros(self.inputs.shape, dtype=torch.uint8, pin_memory=self.is_cuda)
        for buffer in (self.inputs, self.host):
            wide, narrow = self._input_rows(buffer)
            wide[2:].fill_(-1)
            narrow[0].fill_(-1)
        self.slot_tables = torch.zeros(
            (cache.num_slots, max_blocks), dtype=torch.int64, device=self.device
        )
        # token rows, as the kernels take them
        self.rows = torch.arange(max_batch, dtype=torch.int32, device=self.device)
        self.rows_long = self.rows.long()  # the same, as the head's catch-up indexes

    def _input_rows(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The int64 [WIDE_ROWS, width] and int32 [NARROW_ROWS, width] rows of an input buffer
        (views)."""
        split = WIDE_ROWS * 8 * self.width
        wide = buffer[:split].view(torch.int64).view(WIDE_ROWS, -1)
        return wide, buffer[split:].view(torch.int32).view(NARROW_ROWS, -1)

    def set_table(self, slot: int, table: torch.Tensor) -> None:
        """The block table of the request now in `slot` (at most `max_blocks` blocks)."""
        self.slot_tables[slot].zero_()
        self.slot_tables[slot, : table.shape[0]].copy_(table)

    def _batch(self, size: int) -> GpuStepBatch:
        """The step over the first `size` items of the static inputs (a capture records the
        one op here, the tables' gather): padding items (slot -1) write KV row -1 and read
        nothing."""
        wide, narrow = self._input_rows(self.inputs)
        tokens, positions, kv_index, head_kv_index = wide[:, :size]
        slots, seq_lens, table_rows = narrow[:, :size]
        mtp = None
        if self.model.mtp is not None:  # each row's head keys from its slot's saved hidden state
            slot_rows = slots.long()
            mtp = MtpRows(head_kv_index, -1 - slot_rows, self.rows_long[:size], slot_rows)
        meta = StepMeta(
            rows=self.rows[:size],
            slots=slots,
            seq_lens=seq_lens,
            block_tables=self.slot_tables.index_select(0, table_rows),  # [size, max_blocks]
            max_seq_len=self.max_blocks * self.cache.block_size,
            prefill=(),
        )
        return GpuStepBatch(
            input_ids=tokens,
            positions=positions,
            kv_index=kv_index,
            spans=(),
            logits_index=None,
            token_slots=slots,
            mtp=mtp,
            meta=meta,
        )

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture every bucket (or `sizes`, again: tools/step_tiles.py), largest first (so
        smaller ones reuse its memory pool)."""
        self._capture(sizes or batch_buckets(self.max_batch))

    def can_run(self, num_items: int, num_blocks: int) -> bool:
        """Whether `num_items` single-token items whose tables hold at most `num_blocks`
        blocks fit a captured bucket."""
        return (
            bool(self.graphs) and 0 < num_items <= self.max_batch and num_blocks <= self.max_blocks
        )

    @torch.inference_mode()
    def run(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        kv_rows: list[int],
        sampled: list[int],
        copy: bool = True,
        rope_positions: list[int] | None = None,
        head_kv_rows: list[int] | None = None,
    ) -> torch.Tensor | None:
        """Replay the smallest bucket that holds the items (one `can_run`): each a token (-1:
        its slot's last sample) at a position, its slot and the KV row it writes; its rotary
        position is `rope_positions`' where given (a request after images: engine/rank/mrope.py);
        with an MTP head, `head_kv_rows` are the KV rows of the head's keys at the positions
        before (-1: none). Returns fp32 logits of the rows `sampled` on rank 0, None on the
        others; without `copy`, where every row samples, rows of the graph's output buffer,
        which the next replay overwrites."""
        n = len(tokens)
        size = min(b for b in self.graphs if b >= n)
        pad = [0] * (self.width - n)
        no_slot = [-1] * (self.width - n)
        rotary = positions if rope_positions is None else rope_positions
        head = [-1] * n if head_kv_rows is None else head_kv_rows
        wide = torch.tensor(
            [tokens + pad, rotary + pad, kv_rows + no_slot, head + no_slot], dtype=torch.int64
        )
        narrow = torch.tensor(
            [slots + no_slot, [p + 1 for p in positions] + pad, slots + pad], dtype=torch.int32
        )
        values = torch.cat((wide.view(-1).view(torch.uint8), narrow.view(-1).view(torch.uint8)))
        self._upload(values, self.host, self.inputs)
        _, logits = self._replay(size)
        if logits is None:
            return None
        if len(sampled) < n:
            return logits[to_device(sampled, torch.int64, logits.device)]
        return logits[:n].clone() if copy else logits[:n]
