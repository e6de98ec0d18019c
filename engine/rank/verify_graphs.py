"""CUDA graphs of speculative decoding's verify steps and their rollback (speculative.py).

A verify item runs its last sample and k drafts, k + 1 rows, in one target forward; eagerly
that is a prompt-like forward (~450 launches from Python, several times the GPU's work at
small batch) and a rollback of ~10 launches per DeltaNet layer. Here a step whose chunks are
all verify spans of one k replays two graphs per (batch bucket, k):

- the forward: every row attends as a decode row does, to its own position, through the
  paged decode kernel (`StepMeta.attend_rows`: the span's keys are stored before they are
  read, so this is causal within the span, and it is the kernel the rows would meet decoding
  one by one); the DeltaNet layers take the spans packed (conv, fla's chunked kernel), writing
  no recurrent state (store slot -1); each layer's inputs, the spans' conv windows from before
  the step and the final hidden states are copied into static buffers (the stash); the MTP
  head's catch-up runs inside. The logits are taken outside, over the real rows only (one
  GEMM; a graph's own logits would be a vocabulary-wide buffer per bucket and k).
- the rollback, once the accepted counts are known (a small upload): each span's conv window
  and recurrent state over its accepted + 1 first positions, from the stash (the same chunked
  kernel, the spans' rows packed on the device), and its saved hidden state.

Static inputs, one int64 buffer: rows [token | position | KV row | head KV row | head hidden
source | context length | block-table row] (T = bucket x (k + 1) each), spans [first row |
length | slot] (S = bucket + 1, the last always empty), cumulative lengths (S + 1), the chunk
table (bucket x 2), each span's last row (bucket); then the accepted counts (bucket). Padding
spans are empty (slot -1: the kernels and `store_states` skip it), padding rows write no keys.
Off CUDA a replay runs the same on the same buffers eagerly (cudagraph.py).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.rank.batch import MtpRows, StepPlan
from deltaserve.engine.rank.cache import StateCache
from deltaserve.engine.rank.cudagraph import BucketGraphs, DecodeGraphs, batch_buckets
from deltaserve.engine.rank.mtp import mtp_row_lists
from deltaserve.engine.rank.step_meta import GpuStepBatch, PackedSpans, StepMeta
from deltaserve.kernels import gated_delta
from deltaserve.kernels.causal_conv1d import span_blocks
from deltaserve.kernels.gated_delta import CHUNK_SIZE, gated_delta_prefill, store_states


def verify_capturable(device: torch.device) -> bool:
    """Whether verify steps can be captured on `device`: everywhere off CUDA (nothing is
    captured there), on CUDA with fla's chunked kernel (the DeltaNet's torch reference loops
    over the spans on the host)."""
    # through the module: a test switches fla off by patching it there
    return device.type != "cuda" or gated_delta.fla_chunk_kernel() is not None


def stash_bytes(config: ModelConfig, spans: int, drafts: int, tp: int, dtype: torch.dtype) -> int:
    """Bytes of the verify graphs' static stash (`VerifyStashBuffers`) for up to `spans`
    spans of `drafts` + 1 rows on one rank: the memory budget reserves them."""
    rows = spans * (drafts + 1)
    conv = config.linear_conv_dim // tp
    per_row = len(config.linear_attention_layers) * (
        2 * conv + 2 * config.linear_num_value_heads // tp
    )
    windows = (
        len(config.linear_attention_layers) * spans * conv * (config.linear_conv_kernel_dim - 1)
    )
    return (rows * (per_row + config.hidden_size) + windows) * dtype.itemsize


FORWARD, ROLLBACK = 0, 1  # the two graphs of a (bucket, k)
ROW_PARTS = 7  # token, position, KV row, head KV row, head hidden source, length, table row


class VerifyStashBuffers:
    """The static stash of the verify graphs: each DeltaNet layer's inputs (pre-conv qkv,
    post-conv qkv, a, b) and the final hidden state of up to `rows` rows, made at the first
    forward (the warm-up before the first capture) in the layers' shapes; the spans' conv
    windows from before the step."""

    def __init__(self, cache: StateCache, rows: int, spans: int) -> None:
        self.rows = rows
        self.layers: dict[int, tuple[torch.Tensor, ...]] = {}
        self.hidden: torch.Tensor | None = None
        self.windows = torch.zeros(
            (cache.conv.shape[0], spans, *cache.conv.shape[2:]),
            dtype=cache.conv.dtype,
            device=cache.conv.device,
        )

    def _into(self, buffer: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        if buffer is None:
            buffer = torch.zeros((self.rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        buffer[: x.shape[0]].copy_(x)
        return buffer

    def keep(
        self, layer: int, qkv: torch.Tensor, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> None:
        held = self.layers.get(layer, (None,) * 4)
        self.layers[layer] = tuple(
            self._into(buffer, x) for buffer, x in zip(held, (qkv, mixed, a, b), strict=True)
        )

    def keep_hidden(self, hidden: torch.Tensor) -> None:
        self.hidden = self._into(self.hidden, hidden)


class VerifyGraphs(BucketGraphs):
    """The verify forward and rollback graphs of `model` over `cache` per (batch bucket up to
    `max_batch`, k in 1..`max_drafts`); block tables from `decode`'s per-slot tables."""

    def __init__(
        self,
        model: nn.Module,
        cache: StateCache,
        decode: DecodeGraphs,
        max_batch: int,
        max_drafts: int,
    ) -> None:
        if model.mtp is None:  # speculation drafts with the MTP head, and verifies catch it up
            raise ValueError("verify graphs need a model with an MTP head")
        if max_batch < 1 or max_drafts < 1:
            raise ValueError(
                f"max_batch and max_drafts must be >= 1, got {max_batch}, {max_drafts}"
            )
        super().__init__(model, cache)
        self.decode = decode
        self.max_batch = max_batch
        self.max_drafts = max_drafts
        rows = max_batch * (max_drafts + 1)
        self.inputs = torch.zeros(
            self._layout_size(max_batch, max_drafts), dtype=torch.int64, device=self.device
        )
        self.host = torch.zeros(self.inputs.shape, dtype=torch.int64, pin_memory=self.is_cuda)
        self.accepted = torch.full((max_batch,), -1, dtype=torch.int64, device=self.device)
        self.host_accepted = torch.zeros(max_batch, dtype=torch.int64, pin_memory=self.is_cuda)
        self.stash = VerifyStashBuffers(cache, rows, max_batch)
        self.rows = torch.arange(rows, dtype=torch.int64, device=self.device)
        self.deltanets = [layer.linear_attn for layer in model.model.layers if layer.is_linear]
        self.key: tuple[int, int] | None = None  # the (bucket, k) last run forward

    def _parts(self, size: int, drafts: int) -> list[int]:
        """The sizes of a (bucket, k)'s pieces of the static inputs, in order (see above)."""
        t, s = size * (drafts + 1), size + 1
        return [*[t] * ROW_PARTS, s, s, s, s + 1, 2 * size, size]

    def _layout_size(self, size: int, drafts: int) -> int:
        return sum(self._parts(size, drafts))

    def _views(self, size: int, drafts: int) -> list[torch.Tensor]:
        return list(self.inputs[: self._layout_size(size, drafts)].split(self._parts(size, drafts)))

    def _forward(self, key: tuple[int, int, int]) -> tuple[torch.Tensor | None, None]:
        size, drafts, phase = key
        if phase == ROLLBACK:
            self._roll(size, drafts)
            return None, None
        return self._verify(size, drafts), None

    def _verify(self, size: int, drafts: int) -> torch.Tensor:
        """The target's forward over the bucket's verify spans (tensor ops only): every row's
        final hidden state, its layers' inputs kept in the stash buffers."""
        parts = self._views(size, drafts)
        tokens, positions, kv_index, head_kv, head_src, context, table_rows = parts[:ROW_PARTS]
        offsets, span_lengths, slots, bounds, blocks, last_rows = parts[ROW_PARTS:]
        i32 = torch.int32
        rows = size * (drafts + 1)
        self.stash.windows[:, :size] = self.cache.conv[:, slots[:size].clamp(min=0)]
        packed = PackedSpans(
            torch.stack((offsets, span_lengths, slots)).to(i32),
            bounds.to(i32),
            blocks.view(size, 2).to(i32),
            drafts + 1,
            False,
            store_slots=torch.full_like(slots, -1, dtype=i32),  # read, not written
        )
        none = torch.zeros(0, dtype=i32, device=self.device)
        tables = self.decode.slot_tables.index_select(0, table_rows)
        meta = StepMeta(
            rows=none,
            slots=none,
            seq_lens=none,
            block_tables=torch.zeros((0, 1), dtype=torch.int64, device=self.device),
            max_seq_len=self.decode.max_blocks * self.cache.block_size,
            prefill=(),
            packed=packed,
            attend_rows=(self.rows[:rows].to(i32), context.to(i32), tables),
        )
        mtp = MtpRows(head_kv, head_src, last_rows, slots[:size])
        batch = GpuStepBatch(
            tokens, positions, kv_index, (), None, mtp=mtp, stash=self.stash, meta=meta
        )
        return self.model.hidden_states(batch, self.cache)

    def _roll(self, size: int, drafts: int) -> None:
        """Each span's conv window and recurrent state over its accepted + 1 first positions
        (`self.accepted`, -1 for padding spans), and its saved hidden state (tensor ops)."""
        parts = self._views(size, drafts)
        slots, _, blocks = parts[ROW_PARTS + 2], parts[ROW_PARTS + 3], parts[ROW_PARTS + 4]
        cache, stash = self.cache, self.stash
        i32 = torch.int32
        width = drafts + 1
        rows = size * width
        kept = self.accepted[:size] + 1  # [size] positions kept; padding 0
        span_slots = slots[:size].to(i32)
        all_slots = slots.to(i32)  # with the last, empty span (fla's padding entries name it)
        ends = kept.cumsum(0)
        bounds = torch.cat((kept.new_zeros(1), ends, ends[-1:]))  # the last span: empty
        packed = self.rows[:rows]  # packed row p: span `span`'s row p - its start
        span = torch.searchsorted(ends, packed, right=True).clamp(max=size - 1)
        source = (span * width + packed - bounds[span]).clamp(0, rows - 1)
        window = cache.conv.shape[-1]
        columns = kept[:, None] + torch.arange(window, device=self.device)
        for deltanet in self.deltanets:
            layer = deltanet.cache_layer
            qkv, mixed, a, b = (x[:rows] for x in stash.layers[layer])
            inputs = qkv.view(size, width, -1).transpose(1, 2).to(cache.conv.dtype)
            joined = torch.cat((stash.windows[layer, :size], inputs), dim=-1)
            rolled = joined.gather(-1, columns[:, None, :].expand(-1, joined.shape[1], -1))
            store_states(cache.conv[layer], span_slots, rolled.contiguous())
            gated_delta_prefill(
                mixed[source],
                a[source],
                b[source],
                deltanet.A_log,
                deltanet.dt_bias,
                cache.recurrent[layer],
                all_slots,
                bounds.to(i32),
                blocks.view(size, 2).to(i32),
                deltanet.num_k_heads,
            )
        last = (self.rows[:size] * width + kept - 1).clamp(min=0)
        cache.hidden[slots[:size]] = stash.hidden[last]  # padding: the spare row

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (bucket, k)'s two graphs, largest first, over empty spans (writes
        nothing): the forward's warm-up makes the stash buffers the rollback reads."""
        self._fill(self.max_batch, self.max_drafts, StepPlan())
        self._forward((self.max_batch, self.max_drafts, FORWARD))
        keys = [
            (size, drafts, phase)
            for size in batch_buckets(self.max_batch)
            for drafts in range(1, self.max_drafts + 1)
            for phase in (FORWARD, ROLLBACK)
        ]
        self._capture(keys, lambda key: self._fill(key[0], key[1], StepPlan()))

    def fits(self, plan: StepPlan, num_blocks: int) -> bool:
        """Whether `plan` is verify spans only, all of one k within a captured graph, every
        row sampled, its tables at most `num_blocks` <= the decode graphs' blocks."""
        spans = plan.spans
        if not self.graphs or not spans or len(spans) > self.max_batch:
            return False
        width = spans[0].length
        return (
            1 < width <= self.max_drafts + 1
            and all(s.verify and s.length == width for s in spans)
            and len(plan.sampled) == len(plan.ids)
            and not plan.last_sample_rows
            and not plan.vision_rows
            and num_blocks <= self.decode.max_blocks
        )

    def _fill(self, size: int, drafts: int, plan: StepPlan) -> None:
        """Write `plan` padded to (bucket `size`, k `drafts`) into the static inputs."""
        rows, real = size * (drafts + 1), len(plan.ids)
        pad, empty = rows - real, size + 1 - len(plan.spans)
        spans = plan.spans
        head_kv, head_src, last_rows, _ = mtp_row_lists(plan, self.cache.block_size)
        lengths = [s.length for s in spans] + [0] * empty
        values = [
            *plan.ids,
            *[0] * pad,
            *plan.positions,
            *[0] * pad,
            *plan.kv_rows,
            *[-1] * pad,
            *head_kv,
            *[-1] * pad,
            *head_src,
            *[0] * pad,
            *[p + 1 for p in plan.positions],
            *[0] * pad,
            *[s.slot for s in spans for _ in range(s.length)],
            *[0] * pad,
            *[s.offset for s in spans],
            *[real] * empty,
            *lengths,
            *[s.slot for s in spans],
            *[-1] * empty,
            0,
            *itertools.accumulate(lengths),
            *[v for entry in span_blocks(lengths, CHUNK_SIZE, size) for v in entry],
            *last_rows,
            *[0] * (size - len(spans)),
        ]
        self._upload(
            torch.tensor(values, dtype=torch.int64),
            self.host[: len(values)],
            self.inputs[: len(values)],
        )

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Replay the forward of the smallest bucket that holds `plan` (one `fits`): its rows'
        final hidden states (the graph's buffer: read them before the next replay). The
        stash it leaves is for `roll_forward`."""
        drafts = plan.spans[0].length - 1
        size = min(b for b in batch_buckets(self.max_batch) if b >= len(plan.spans))
        self._fill(size, drafts, plan)
        self.key = (size, drafts)
        hidden, _ = self._replay((size, drafts, FORWARD))
        return hidden[: len(plan.ids)]

    @torch.inference_mode()
    def roll_forward(self, accepted: list[int]) -> None:
        """Replay the rollback of the last `run`: span i keeps its first accepted[i] + 1
        positions."""
        size, drafts = self.key
        values = torch.full((self.max_batch,), -1, dtype=torch.int64)
        values[: len(accepted)] = torch.tensor(accepted, dtype=torch.int64)
        self._upload(values, self.host_accepted, self.accepted)
        self._replay((size, drafts, ROLLBACK))
