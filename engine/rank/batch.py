"""The flattened inputs of one unified step, built by the executor, read by every layer.

Tokens of all requests in the step are laid end to end; each request's piece is a `SeqSpan`.
Passed explicitly to every layer's forward (no global context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.engine.rank.mrope import frequency_positions


@dataclass(frozen=True, slots=True)
class SeqSpan:
    offset: int  # index of the span's first token in the flat batch
    length: int  # tokens of this request in the step (1 for a decode item)
    start: int  # position of the span's first token within its request
    slot: int  # DeltaNet state slot
    block_table: torch.Tensor  # [blocks] int64, KV blocks of the request in order
    blocks: tuple[int, ...] | list[int] = ()  # the same on the host (prompt graphs read it)
    # speculative decoding's verify span: its DeltaNet recurrent state is read, not written,
    # until the accepted positions are known (engine/rank/speculative.py)
    verify: bool = False

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True, slots=True)
class StepVision:
    """A step's vision tokens: their rows take the tower's embeddings instead of the token
    embeddings, and every row turns by its three multimodal positions (engine/rank/mrope.py).
    A prompt graph's (static shapes) flags every row instead of listing the vision ones."""

    # [V] int64, flat rows of the step's vision tokens; or [T] bool, True at them
    rows: torch.Tensor
    embeds: torch.Tensor  # [V, hidden]; with flags [T, hidden], read at the flagged rows only
    rope_rows: torch.Tensor  # [3, T]: each row's temporal, height and width positions
    axis: torch.Tensor  # [rotary_dim / 2]: the one of the three each frequency turns by

    @property
    def rope_positions(self) -> torch.Tensor:
        """[T, rotary_dim / 2]: the position each row's frequency turns by."""
        return frequency_positions(self.rope_rows, self.axis)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [T, hidden], the token embeddings, with the vision rows' replaced."""
        if self.rows.dtype == torch.bool:  # one kernel of fixed shapes
            return torch.where(self.rows[:, None], self.embeds.to(x.dtype), x)
        x[self.rows] = self.embeds.to(x.dtype)
        return x


@dataclass(frozen=True, slots=True)
class StepBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    kv_index: torch.Tensor  # [T] int64, flat KV cache row (block * block_size + offset) per token
    spans: tuple[SeqSpan, ...]
    # [S] int64, flat index of each token whose next token is sampled; None: every token's (a
    # decode graph: no gather kernel between the final norm and the lm_head)
    logits_index: torch.Tensor | None
    # [T] int32 or None: a row of input_ids -1 is the last sample of this slot (a decode graph's
    # step, queued before the host knows the step before's samples: `cache.last_tokens`)
    token_slots: torch.Tensor | None = None
    vision: StepVision | None = None  # steps that hold images' or video frames' tokens
    # with an MTP head (engine/rank/mtp.py): where each row's keys and values of the head go
    mtp: MtpRows | None = None
    # a step with verify spans: what their DeltaNet layers leave for the rollback
    stash: object | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, slots=True)
class MtpRows:
    """The MTP head's catch-up over a step (engine/rank/mtp.py): row r of the step feeds the
    head's position positions[r] - 1 (its token with the target's hidden state of the
    position before), whose keys and values go to `kv_index[r]` (-1: none, a prompt's first
    row), the hidden state from row `hidden_src[r]` of the step, or from the slot's saved one
    where it is -1 - slot. `last_rows` / `last_slots` [S]: each span's last row, whose hidden
    state the slot keeps for the next step (slot -1: padding, the cache's spare row)."""

    kv_index: torch.Tensor  # [T] int64
    hidden_src: torch.Tensor  # [T] int64
    last_rows: torch.Tensor  # [S] int64
    last_slots: torch.Tensor  # [S] int64


@dataclass(slots=True)
class StepPlan:
    """A step's inputs as host lists, before they go to the device (as a StepBatch, or into a
    prompt graph's static buffers)."""

    spans: list[SeqSpan] = field(default_factory=list)
    # -1 where an item has no token (its slot's last sample)
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    kv_rows: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # rows whose logits are returned
    last_sample_rows: list[int] = field(default_factory=list)  # items without token_ids
    last_sample_slots: list[int] = field(default_factory=list)
    # vision tokens: their flat rows, embeddings (runs of rows) and height and width positions
    # (their temporal one is in `positions`, as is every text token's only one)
    vision_rows: list[int] = field(default_factory=list)
    vision_embeds: list[torch.Tensor] = field(default_factory=list)
    vision_heights: list[int] = field(default_factory=list)
    vision_widths: list[int] = field(default_factory=list)
