"""CUDA graphs of prompt steps: the first chunks of up to `max_seqs` prompts, per token bucket.

Run eagerly, a prompt step is bound by the host, not the GPU: ~450 launches and their Python
cost 55-64 ms on the H200 whatever the prompt's length, against 16 ms of kernels at 1,024
tokens (bench/results/prefill_host_profile_h200_at_81901e4.json). So one graph per token
bucket (16, 32, ... `max_tokens`) holds the whole forward, fla's chunked DeltaNet and
flash's attention included: every kernel of a prompt step takes its grid from the sizes of
`PackedSpans`' tensors, and here those are fixed per bucket. The step is written into padded
buffers: spans after its own are empty (length 0, slot -1), the last one always, and the
block table's spare entries name that one; rows after its tokens are padding (KV row -1,
in no span), computed and never read. vLLM captures its prompt-sized graphs piecewise, with
attention left eager; here nothing is left out, because the chunked DeltaNet and the varlen
attention need no host-side sizes.

Only steps whose chunks are all their prompts' first qualify (attention then reads no cached
keys), unless the engine caches prefixes (`prefix_keys`): then a chunk may follow cached
positions (its prompt's saved prefix, or its own earlier chunk), and attention gathers each
span's KV blocks from position 0 (`KeyBlocks`, up to `prefix_keys` positions before the
step's tokens in all) for flash's varlen kernel; others run eagerly. On CUDA the graphs need
fla (the chunked DeltaNet's torch reference loops over the spans on the host) and a dtype flash
takes; without them prompts run eagerly (`capturable`). Off CUDA (the GPU path under Triton's
interpreter, in tests) nothing is captured and `run` runs the model on the same padded buffers
eagerly, so CI covers the padding.

Chunks holding image or video tokens replay too (a model with a vision tower: `vision_axis`):
the tower runs eagerly before the step (vision_inputs.py), its embeddings are copied into a
buffer of the graphs' that replaces the token embeddings at the rows flagged, and every row's
three rotary positions (mrope.py; a text token's three are equal: plain RoPE) are static
inputs. So an image's chunk costs the decodes beside it what a text chunk of its length does,
plus the tower's eager forward (they replay their own graph). A text-only model's graphs
have neither input.

With an MTP head (engine/rank/mtp.py) the graphs run the head's catch-up too: each row's head
KV row and where its hidden state comes from, each span's last row and slot (`MtpRows`) are
static inputs, padded with KV row -1 and the cache's spare hidden row.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from deltaserve.engine.rank.batch import MtpRows, StepPlan, StepVision
from deltaserve.engine.rank.cache import StateCache
from deltaserve.engine.rank.cudagraph import BucketGraphs
from deltaserve.engine.rank.mtp import mtp_row_lists
from deltaserve.engine.rank.step_meta import GpuStepBatch, PackedSpans, StepMeta
from deltaserve.kernels import gated_delta
from deltaserve.kernels.causal_conv1d import span_blocks
from deltaserve.kernels.gated_delta import CHUNK_SIZE
from deltaserve.kernels.paged_attention import KeyBlocks, flash_takes

MIN_BUCKET = 16
# prompts per prompt-graph step: each padding span still gathers its (unused) DeltaNet state
# for fla, 2 MiB per layer at 4B shapes, so the spans are kept few; more run eagerly
PROMPT_GRAPH_SEQS = 8
# with prefix caching: cached positions a prompt graph's chunks may follow, in all (their keys
# are gathered into a buffer of the graph's, 2 x this x KV heads x head dim, 32 MiB at 4B
# shapes); a step past it runs eagerly
PREFIX_GRAPH_KEYS = 16384


def prefix_graph_keys(prefix_states: int, max_model_len: int) -> int:
    """The prompt graphs' `prefix_keys`: none without prefix caching."""
    return min(PREFIX_GRAPH_KEYS, max_model_len) if prefix_states else 0


def capturable(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a prompt step on `device` runs only kernels with no host-side loop over its
    spans: everywhere off CUDA (nothing is captured there), on CUDA with fla installed and
    attention in flash's varlen kernel."""
    if device.type != "cuda":
        return True
    # through the module: a test switches fla off by patching it there
    return gated_delta.fla_chunk_kernel() is not None and flash_takes(device, dtype, head_dim)


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, ... up to `max_tokens` (itself the last)."""
    sizes, n = [], MIN_BUCKET
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return [*sizes, max_tokens]


class PromptGraphs(BucketGraphs):
    """One CUDA graph per token bucket of prompt-only steps over `model` and `cache`.

    A bucket of T tokens reads one int64 buffer laid out as [tokens | positions | KV rows]
    (T each), then the spans' [first rows | lengths | slots] (S = max_seqs + 1 each), their
    cumulative lengths (S + 1), the block table (entries(T) x 2) and the sampled rows
    (max_seqs), copied to the GPU in one transfer from a pinned buffer; with `prefix_keys`, then
    the spans' KV blocks (`_key_entries`), where each span's keys start (S + 1) and how many
    it attends to (S). With `vision_axis` (a model with a vision tower) the positions are three
    rows (temporal, height, width: 3T; a text token's three equal, which is plain RoPE) and the
    buffer ends with a flag a row (T), 1 where a vision token takes its embedding from
    `vision_embeds` (the tower's output, copied there before the replay). The graph keeps its
    fp32 logits of max_seqs rows, of which `run` returns a copy of the sampled ones, and every
    row's final hidden state, from which the executor takes prompt logprobs.
    """

    def __init__(
        self,
        model: nn.Module,
        cache: StateCache,
        max_tokens: int,
        max_seqs: int,
        prefix_keys: int = 0,
        vision_axis: torch.Tensor | None = None,
    ) -> None:
        if max_tokens < MIN_BUCKET or max_seqs < 1:
            raise ValueError(
                f"prompt graphs need max_tokens >= {MIN_BUCKET} and max_seqs >= 1, "
                f"got {max_tokens}, {max_seqs}"
            )
        super().__init__(model, cache)
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.spans = max_seqs + 1  # the last one always empty
        self.prefix_keys = prefix_keys
        # a model with a vision tower: every row's three rotary positions, and the tower's
        # embeddings at the vision rows (mrope.axis_of_frequencies: which one each frequency takes)
        self.vision_axis = vision_axis
        self.vision_embeds = None
        if vision_axis is not None:
            weight = model.model.embed_tokens.weight
            self.vision_embeds = torch.zeros(
                (max_tokens, model.config.hidden_size), dtype=weight.dtype, device=self.device
            )
        size = self._layout_size(max_tokens)
        self.inputs = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=self.is_cuda)

    def _entries(self, tokens: int) -> int:
        """Block-table entries of a bucket: every span's blocks, the partial ones included."""
        return tokens // CHUNK_SIZE + self.max_seqs

    def _key_entries(self, tokens: int) -> int:
        """KV blocks a bucket gathers (prefix caching): its tokens' and the cached positions'
        before them, a partial block per span."""
        return (tokens + self.prefix_keys) // self.cache.block_size + self.max_seqs

    def _parts(self, tokens: int) -> list[int]:
        """The sizes of a bucket's pieces of the static inputs, in order (see the class)."""
        x, s = tokens, self.spans
        rotary = x if self.vision_axis is None else 3 * x
        parts = [x, rotary, x, 3 * s, s + 1, 2 * self._entries(tokens), self.max_seqs]
        if self.prefix_keys:
            parts += [self._key_entries(tokens), s + 1, s]
        if self.model.mtp is not None:  # MtpRows: head KV rows, hidden sources, last rows, slots
            parts += [x, x, s, s]
        return parts if self.vision_axis is None else [*parts, x]

    def _layout_size(self, tokens: int) -> int:
        return sum(self._parts(tokens))

    def _batch(self, size: int) -> GpuStepBatch:
        """The step over bucket `size`'s views of the static inputs, by tensor ops only (so a
        capture records them)."""
        s, e = self.spans, self._entries(size)
        parts = self.inputs[: self._layout_size(size)].split(self._parts(size))
        tokens, rotary, kv_index, index, bounds, blocks, sampled = parts[:7]
        i32 = torch.int32
        keys = KeyBlocks(parts[7], parts[8].to(i32), parts[9].to(i32)) if self.prefix_keys else None
        first_mtp = 10 if self.prefix_keys else 7
        mtp = MtpRows(*parts[first_mtp : first_mtp + 4]) if self.model.mtp is not None else None
        packed = PackedSpans(
            index.view(3, s).to(i32),
            bounds.to(i32),
            blocks.view(e, 2).to(i32),
            size,
            not self.prefix_keys,
            keys,
        )
        device = self.device
        no_decodes = torch.zeros(0, dtype=i32, device=device)
        meta = StepMeta(
            rows=no_decodes,
            slots=no_decodes,
            seq_lens=no_decodes,
            block_tables=torch.zeros((0, 1), dtype=torch.int64, device=device),
            max_seq_len=1,
            prefill=(),
            packed=packed,
        )
        positions, vision = rotary, None
        if self.vision_axis is not None:  # rows [temporal | height | width], then the flags
            rows = rotary.view(3, size)
            positions = rows[0]
            flags = parts[-1] != 0
            vision = StepVision(flags, self.vision_embeds[:size], rows, self.vision_axis)
        return GpuStepBatch(
            tokens, positions, kv_index, (), sampled, meta=meta, vision=vision, mtp=mtp
        )

    def _fill(self, size: int, plan: StepPlan) -> None:
        """Write `plan` padded to bucket `size` into the static inputs (one pinned copy)."""
        tokens = len(plan.ids)
        pad = size - tokens
        spans = [*plan.spans, *[None] * (self.spans - len(plan.spans))]
        lengths = [s.length if s else 0 for s in spans]
        values = [
            *plan.ids,
            *[0] * pad,
            *plan.positions,
            *[0] * pad,
            *self._vision_positions(plan, pad),
            *plan.kv_rows,
            *[-1] * pad,  # padding rows write no KV
            *[s.offset if s else tokens for s in spans],
            *lengths,
            *[s.slot if s else -1 for s in spans],
            0,
            *itertools.accumulate(lengths),  # cu_seqlens
            *[v for entry in span_blocks(lengths, CHUNK_SIZE, self._entries(size)) for v in entry],
            *plan.sampled,
            *[0] * (self.max_seqs - len(plan.sampled)),
        ]
        if self.prefix_keys:
            values += self._key_values(size, spans)
        if self.model.mtp is not None:
            values += self._mtp_values(size, plan)
        if self.vision_axis is not None:
            flags = [0] * size
            for row in plan.vision_rows:
                flags[row] = 1
            values += flags
            self._fill_vision_embeds(plan)
        self._upload(
            torch.tensor(values, dtype=torch.int64),
            self.host[: len(values)],
            self.inputs[: len(values)],
        )

    def _mtp_values(self, size: int, plan: StepPlan) -> list[int]:
        """The head's catch-up rows (`mtp_row_lists`), padded: padding rows write no keys and
        read row 0's hidden state; empty spans keep row 0's in the spare hidden row (slot -1)."""
        kv_index, hidden_src, last_rows, last_slots = mtp_row_lists(plan, self.cache.block_size)
        pad, empty = size - len(kv_index), self.spans - len(last_rows)
        return [
            *kv_index,
            *[-1] * pad,
            *hidden_src,
            *[0] * pad,
            *last_rows,
            *[0] * empty,
            *last_slots,
            *[-1] * empty,
        ]

    def _vision_positions(self, plan: StepPlan, pad: int) -> list[int]:
        """With a vision tower: every row's height position, then its width one (a text
        token's both are its only one, as padding's)."""
        if self.vision_axis is None:
            return []
        heights, widths = list(plan.positions), list(plan.positions)
        for row, height, width in zip(
            plan.vision_rows, plan.vision_heights, plan.vision_widths, strict=True
        ):
            heights[row], widths[row] = height, width
        return [*heights, *[0] * pad, *widths, *[0] * pad]

    def _fill_vision_embeds(self, plan: StepPlan) -> None:
        """The tower's embeddings into their rows of the buffer, one device copy a run (each
        of `plan.vision_embeds` is a run of adjacent rows: an image's tokens in one chunk).
        Queued on the stream after the replay before, which read the buffer."""
        first = 0
        for run in plan.vision_embeds:
            row = plan.vision_rows[first]
            self.vision_embeds[row : row + run.shape[0]].copy_(run)
            first += run.shape[0]

    def _key_values(self, size: int, spans: list) -> list[int]:
        """Each span's KV blocks from position 0 through its chunk, padded with block 0; where
        its keys start among the gathered rows; how many it attends to."""
        bs = self.cache.block_size
        blocks = [[*s.blocks[: -(-s.end // bs)]] if s else [] for s in spans]
        flat = [b for span_blocks in blocks for b in span_blocks]
        starts = itertools.accumulate((len(b) * bs for b in blocks), initial=0)
        return [
            *flat,
            *[0] * (self._key_entries(size) - len(flat)),
            *starts,
            *[s.end if s else 0 for s in spans],
        ]

    def _keys_fit(self, plan: StepPlan) -> bool:
        bucket = min(b for b in token_buckets(self.max_tokens) if b >= len(plan.ids))
        return sum(-(-s.end // self.cache.block_size) for s in plan.spans) <= self._key_entries(
            bucket
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller ones reuse its memory pool), each
        over an empty step: no span, every row padding, so the warm-up writes nothing."""
        self._capture(token_buckets(self.max_tokens), lambda size: self._fill(size, StepPlan()))

    def can_run(self, plan: StepPlan) -> bool:
        """Whether `plan` fits a captured bucket: at most `max_seqs` chunks, every token given,
        each its prompt's first (with `prefix_keys`: whose blocks, cached ones included, fit
        the bucket's gather); vision tokens only where the graphs take them."""
        return (
            bool(self.graphs)
            and 0 < len(plan.ids) <= self.max_tokens
            and (self.vision_axis is not None or not plan.vision_rows)
            and len(plan.spans) <= self.max_seqs
            and not plan.last_sample_rows
            and all(s.length > 1 for s in plan.spans)
            and (
                self._keys_fit(plan) if self.prefix_keys else all(s.start == 0 for s in plan.spans)
            )
        )

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the smallest bucket that holds `plan` (one `can_run`): the final hidden states
        of its rows (the graph's buffer: read them before the next replay), and fp32 logits of
        its sampled rows on rank 0 (None on the others)."""
        size = min(b for b in self.graphs if b >= len(plan.ids))
        self._fill(size, plan)
        hidden, logits = self._replay(size)
        if logits is not None:  # the graph's buffer is overwritten by the next replay
            logits = logits[: len(plan.sampled)].clone()
        return hidden[: len(plan.ids)], logits
