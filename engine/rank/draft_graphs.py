"""CUDA graphs of the MTP head's draft loop (speculative decoding, engine/rank/speculative.py).

Drafting k tokens runs the head k times, each one row per request: fc over the normed token
embedding and hidden state, the head's decoder layer (attention over its own KV), its norm,
then the argmax over the draft vocabulary (`VocabParallelEmbedding.argmax`, sharded). Eagerly
that is ~30 launches a run from Python, several times the GPU's work at small batch. So one
graph per (batch bucket, k) holds all k runs, each feeding the next its pick and its output `g`
inside the graph, and a draft loop is one replay and one host read of the picks.

Static inputs, one int64 buffer copied from a pinned one: rows [token | slot | table row] then
k rows each of [position | KV row | context length], `width` columns. A request that drafts
fewer steps than the bucket's k keeps running after its last one with KV row -1 (it writes
nothing) and its first step's context; its picks past its steps are not read. Padding rows
(slot -1) read the cache's spare hidden row, write nothing and attend to nothing. Block tables
are the decode graphs' per-slot tables (`DecodeGraphs.slot_tables`), gathered in the graph.
Off CUDA a replay runs the same steps eagerly on the same buffers (cudagraph.py).
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.engine.rank.cache import StateCache
from deltaserve.engine.rank.cudagraph import BucketGraphs, DecodeGraphs, batch_buckets
from deltaserve.engine.rank.step_meta import GpuStepBatch, StepMeta

HEAD_ROWS = 3  # token, slot, block-table row
STEP_ROWS = 3  # per draft step: position, KV row, context length


class DraftGraphs(BucketGraphs):
    """One CUDA graph of the head's draft loop per (batch bucket, steps), over `model`'s MTP
    head and `cache`, drafting among the first `draft_vocab` ids; block tables from
    `decode`'s per-slot tables (and its bucket sizes, max batch and max blocks)."""

    def __init__(
        self,
        model: nn.Module,
        cache: StateCache,
        decode: DecodeGraphs,
        max_steps: int,
        draft_vocab: int,
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        super().__init__(model, cache)
        self.decode = decode
        self.max_steps = max_steps
        self.draft_vocab = draft_vocab
        self.width = decode.max_batch
        rows = HEAD_ROWS + STEP_ROWS * max_steps
        self.inputs = torch.zeros((rows, self.width), dtype=torch.int64, device=self.device)
        self.host = torch.zeros((rows, self.width), dtype=torch.int64, pin_memory=self.is_cuda)
        self.padding = self._padding_values(rows)
        self.inputs.copy_(self.padding)
        self.rows = torch.arange(self.width, dtype=torch.int32, device=self.device)
        self.empty_ids = torch.zeros(0, dtype=torch.int64, device=self.device)

    def _padding_values(self, rows: int) -> torch.Tensor:
        """Every column padding: token 0, slot -1, table row 0; position 0, KV row -1, length 0."""
        values = torch.zeros((rows, self.width), dtype=torch.int64)
        values[1] = -1
        values[HEAD_ROWS + 1 :: STEP_ROWS] = -1
        return values

    def _forward(self, key: tuple[int, int]) -> tuple[torch.Tensor, None]:
        """The head's `steps` runs over the first `size` columns (`key` = (size, steps)): the
        picks [size, steps]. Tensor ops only, so that a capture records them."""
        size, steps = key
        mtp, embed = self.model.mtp, self.model.model.embed_tokens
        tokens, slots, table_rows = self.inputs[:HEAD_ROWS, :size]
        per_step = self.inputs[HEAD_ROWS:, :size].view(self.max_steps, STEP_ROWS, size)
        seq_lens = per_step[:, 2].to(torch.int32)
        slots32 = slots.to(torch.int32)
        tables = self.decode.slot_tables.index_select(0, table_rows)
        hidden = self.cache.hidden[slots]  # slot -1: the spare row
        picks = []
        for step in range(steps):
            meta = StepMeta(
                rows=self.rows[:size],
                slots=slots32,
                seq_lens=seq_lens[step],
                block_tables=tables,
                max_seq_len=self.decode.max_blocks * self.cache.block_size,
                prefill=(),
            )
            batch = GpuStepBatch(
                input_ids=self.empty_ids,  # the rows come fused
                positions=per_step[step, 0],
                kv_index=per_step[step, 1],
                spans=(),
                logits_index=None,
                meta=meta,
            )
            hidden = mtp(mtp.fuse(embed(tokens), hidden), batch, self.cache)
            tokens = self.model.output_embedding.argmax(hidden, self.draft_vocab)
            picks.append(tokens)
        return torch.stack(picks, dim=1), None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (bucket, steps), largest first, over padding only (writes nothing)."""
        keys = [
            (size, steps)
            for size in batch_buckets(self.width)
            for steps in range(1, self.max_steps + 1)
        ]
        self._capture(keys)

    def can_run(self, num_rows: int, steps: int, num_blocks: int) -> bool:
        """Whether `num_rows` requests drafting up to `steps` tokens, whose tables hold at most
        `num_blocks` blocks, fit a captured graph."""
        return (
            bool(self.graphs)
            and 0 < num_rows <= self.width
            and 0 < steps <= self.max_steps
            and num_blocks <= self.decode.max_blocks
        )

    @torch.inference_mode()
    def run(
        self,
        tokens: list[int],
        slots: list[int],
        positions: list[list[int]],
        kv_rows: list[list[int]],
        seq_lens: list[list[int]],
    ) -> torch.Tensor:
        """Replay the smallest graph that holds the rows (one `can_run`): each row's first
        token and slot; per step (outer lists) each row's position, KV row (-1: none) and
        context length. Returns the picks [rows, steps] (the graph's buffer: read it before
        the next replay)."""
        n, steps = len(tokens), len(positions)
        size = min(b for b in batch_buckets(self.width) if b >= n)
        values = self.padding.clone()
        values[:HEAD_ROWS, :n] = torch.tensor([tokens, slots, slots], dtype=torch.int64)
        per_step = torch.tensor([positions, kv_rows, seq_lens], dtype=torch.int64)
        values[HEAD_ROWS : HEAD_ROWS + STEP_ROWS * steps, :n] = per_step.transpose(0, 1).reshape(
            STEP_ROWS * steps, n
        )
        self._upload(values, self.host, self.inputs)
        picks, _ = self._replay((size, steps))
        return picks[:n]
